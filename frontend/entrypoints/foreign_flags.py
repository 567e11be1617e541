"""vLLM's and SGLang's serving flags that have no loraplex setting. Each is accepted where loraplex already does what
it asks (the start-up log says so, one line per flag) or refused at start with one line naming it and why: a command
line copied from either project never has a flag ignored silently. Flags that do map onto a setting are ALIASES in
protocol/config.py, and flags of theirs that are settings of ours under the same name (--load-format, --hf-overrides)
are ServerConfig fields (among them the Hub flags --revision, --tokenizer, --tokenizer-revision,
--download-dir and --hf-token)."""

from __future__ import annotations

from typing import Any, NamedTuple


class ForeignFlag(NamedTuple):
    names: tuple[str, ...]  # option strings, the long one first
    family: str  # whose flag: "vLLM", "SGLang" or "vLLM and SGLang"
    takes_value: bool
    note: str = ""  # why it changes nothing here, logged at start when accepted; "" = never accepted
    refusal: str = ""  # why it is refused; "" = always accepted
    ok_values: tuple[str, ...] = ()  # with both a note and a refusal: the values accepted, the rest refused
    sets: dict[str, Any] | None = None  # settings it stands for, when given

    @property
    def dest(self) -> str:
        return "foreign_" + self.names[0].lstrip("-").replace("-", "_")

    @property
    def summary(self) -> str:
        """What happens when it is given (for --help and docs/API.md)."""
        if not self.refusal:
            return f"accepted: {self.note}"
        if not self.note:
            return f"refused: {self.refusal}"
        return f"accepted as {' or '.join(self.ok_values)} ({self.note}); any other value refused: {self.refusal}"

    def check(self, value: str | None) -> str:
        """The start-up note for this flag given with this value; raises ValueError (the reason) when refused."""
        given = self.names[0] if value is None else f"{self.names[0]} {value}"
        if self.note and (not self.refusal or (value is not None and value.lower() in self.ok_values)):
            return f"{given}: {self.note}"
        raise ValueError(f"{given}: {self.refusal}")


def _accept(
    *names: str, family: str, note: str, value: bool = False, sets: dict[str, Any] | None = None
) -> ForeignFlag:
    return ForeignFlag(names, family, value, note=note, sets=sets)


def _refuse(*names: str, family: str, why: str, value: bool = True) -> ForeignFlag:
    return ForeignFlag(names, family, value, refusal=why)


def _only(*names: str, family: str, ok: tuple[str, ...], note: str, why: str) -> ForeignFlag:
    return ForeignFlag(names, family, True, note=note, refusal=why, ok_values=ok)


V, S, VS = "vLLM", "SGLang", "vLLM and SGLang"
_LATER = "not supported yet"

FOREIGN_FLAGS: tuple[ForeignFlag, ...] = (
    # -- model loading
    _accept("--trust-remote-code", family=VS, note="loraplex never runs code from a checkpoint: its model classes are "
            "built in (docs/MODELS.md), so this changes nothing"),
    _only("--tokenizer-mode", family=VS, ok=("auto",), note="the tokenizer's own (fast) mode, as auto means",
          why="only auto: the tokenizer is loaded as transformers' AutoTokenizer does"),
    _only("--generation-config", family=V, ok=("vllm",), note="sampling defaults are vLLM's own",
          why="loraplex does not apply generation_config.json's sampling defaults (it reads only its eos_token_id); "
          "give --generation-config vllm, or set the sampling options per request"),
    _refuse("--skip-tokenizer-init", family=VS, why="requests are text or token ids and answers are detokenized: the "
            "tokenizer is always loaded", value=False),
    # -- parallelism and memory
    _only("--pipeline-parallel-size", "-pp", family=VS, ok=("1",), note="one pipeline stage",
          why="pipeline parallelism is not supported: use --tensor-parallel-size (with --nnodes across nodes)"),
    _only("--distributed-executor-backend", family=V, ok=("mp",), note="workers are local processes",
          why="workers are local processes started by the server (mp); multi-node runs use --nnodes"),
    _accept("--disable-custom-all-reduce", family=V, note="collectives are torch.distributed's (NCCL on CUDA)"),
    _only("--cpu-offload-gb", family=V, ok=("0",), note="no weights offloaded", why="weights cannot be offloaded "
          "to host memory"),
    _accept("--swap-space", family=V, value=True, note="preempted requests are recomputed, never swapped"),
    _refuse("--base-gpu-id", family=S, why="choose GPUs with CUDA_VISIBLE_DEVICES"),
    # -- scheduling and CUDA graphs
    _accept("--enable-prefix-caching", family=V, note="the prefix cache is on by default "
            "(--no-enable-prefix-caching turns it off)", sets={"disable_radix_cache": False,
                                                               "no_enable_prefix_caching": False}),
    _accept("--enable-chunked-prefill", family=V, note="chunked prefill is on by default (--chunked-prefill-size)"),
    _accept("--no-enable-chunked-prefill", family=V, note="whole prompts per step, as --chunked-prefill-size -1",
            sets={"chunked_prefill_size": -1}),
    _accept("--max-seq-len-to-capture", family=V, value=True, note="CUDA graphs are captured per decode batch size "
            "(--cuda-graph-max-bs), for any sequence length"),
    _only("--schedule-policy", family=S, ok=("fcfs",), note="requests run first come, first served",
          why="requests run first come, first served (fcfs); no other policy is supported"),
    _accept("--disable-overlap-schedule", family=S, note="the next batch is always scheduled while the last one "
            "runs; overlap cannot be turned off"),
    _refuse("--enable-torch-compile", family=S, why="torch.compile is not used: decode runs eagerly or from CUDA "
            "graphs (--enable-cuda-graph)", value=False),
    _accept("--skip-server-warmup", family=S, note="loraplex sends no warm-up request"),
    _refuse("--enable-sleep-mode", family=V, why="sleep mode is not supported", value=False),
    # -- LoRA
    _only("--lora-dtype", family=V, ok=("auto",), note="adapters take the model's dtype",
          why="adapter weights always take the model's dtype (--dtype); only auto"),
    _accept("--fully-sharded-loras", family=V, note="adapters are sharded as the base layers are (docs/ARCHITECTURE.md"
            "); the outputs are the same"),
    _refuse("--long-lora-scaling-factors", family=V, why="long-context LoRA is not supported"),
    _refuse("--enable-lora-bias", family=V, why="LoRA bias terms are not supported", value=False),
    _only("--lora-eviction-policy", family=S, ok=("lru",), note="device slots evict the least recently used adapter",
          why="device slots evict the least recently used adapter (lru); no other policy"),
    _only("--response-role", family=V, ok=("assistant",), note="chat answers come from the assistant",
          why="chat answers always come from the assistant role"),
    # -- HTTP server and logging
    _accept("--disable-log-requests", family=V, note="loraplex never logs requests"),
    _refuse("--enable-log-requests", family=V, why="loraplex does not log requests", value=False),
    _refuse("--log-requests", family=S, why="loraplex does not log requests", value=False),
    _accept("--max-log-len", family=V, value=True, note="loraplex never logs requests"),
    _accept("--disable-log-stats", family=V, note="loraplex logs no periodic statistics (GET /metrics has them)"),
    _accept("--enable-metrics", family=S, note="GET /metrics is always served"),
    _accept("--uvicorn-log-level", family=V, value=True, note="the HTTP server is aiohttp; --log-level sets its "
            "logging"),
    _accept("--log-level-http", family=S, value=True, note="--log-level sets the HTTP server's logging"),
    _accept("--disable-frontend-multiprocessing", family=V, note="the frontend is one process"),
    _refuse("--ssl-keyfile", family=VS, why="loraplex serves plain HTTP: terminate TLS in a proxy"),
    _refuse("--ssl-certfile", family=VS, why="loraplex serves plain HTTP: terminate TLS in a proxy"),
    _refuse("--root-path", family=V, why="routes are served at /; strip a prefix in the proxy"),
)
FOREIGN_BY_DEST: dict[str, ForeignFlag] = {flag.dest: flag for flag in FOREIGN_FLAGS}
