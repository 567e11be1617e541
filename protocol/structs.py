"""Every struct that crosses a process boundary. One tagged union per socket direction (bottom of file)."""

from __future__ import annotations

from typing import Union

import msgspec
from loraplex.protocol.config import ServerConfig


class Struct(msgspec.Struct, tag=True, kw_only=True):
    pass


# ---- shared pieces -----------------------------------------------------------------------------


class OutputConstraint(msgspec.Struct, frozen=True, array_like=True):
    """Structured output: the text must match `source`, read as `kind` says. The frontend checks that it compiles
    before the request is admitted; the sampling worker (rank 0) compiles it again and masks every step with it."""

    # "json_schema" (source: the schema as JSON text), "regex", "ebnf" (an xgrammar EBNF grammar) or
    # "structural_tag" (xgrammar's structural tag as JSON text, protocol/grammar.py)
    kind: str
    source: str
    # With a reasoning parser: the output token ids that end the reasoning (`</think>`); the grammar applies to the
    # tokens after their first occurrence, and the reasoning before it is free. () = from the first token.
    start_after: tuple[int, ...] = ()


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: list[int] = []
    # -1: no logprobs; N >= 0: each output token's logprob, and the N most likely tokens' (log-softmax of the raw
    # logits, adapter applied, before temperature / top-k / top-p)
    logprobs: int = -1
    # Penalties (vLLM's definitions): presence/frequency subtract from the logits of tokens in the output so far
    # (once, or per occurrence); repetition divides positive logits (multiplies negative ones) of every token in
    # the prompt or the output. Neutral: 0, 0, 1.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # tokens below min_p x the top token's probability are dropped (after temperature)
    min_new_tokens: int = 0  # stop_token_ids cannot be sampled before this many output tokens
    # >= 0: the logprob of every prompt token from this position on (the first prompt token's is null), with
    # prompt_top_logprobs alternatives; -1: none
    logprob_start_len: int = -1
    prompt_top_logprobs: int = 0
    constraint: OutputConstraint | None = None  # structured output; its stop tokens are stop_token_ids
    # vLLM's logit controls, applied before the penalties (worker/penalties.py); the frontend checks every id
    # against the vocabulary. Neutral: {}, None, [].
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # token sequences the output must not contain: a sequence's last token is banned where the output so far ends
    # with the rest of it (a one-token sequence: always)
    bad_words_ids: list[list[int]] = []

    @property
    def uses_penalty(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def allows_drafts(self) -> bool:
        """Whether speculative decoding may draft for it: every verify row is processed as without drafts (penalties,
        logit controls, min_new_tokens and a grammar after the drafts before it; worker/speculative.py). A grammar
        that starts after a reasoning section, or one on a request sampled without a seed (only rank 0 masks, and the
        ranks' shared generator must draw alike), decodes one token a pass."""
        constraint = self.constraint
        return constraint is None or not (constraint.start_after or (self.temperature > 0.0 and self.seed is None))

    @property
    def needs_token_history(self) -> bool:
        """Whether sampling reads the tokens so far (penalties, bad words of several tokens): the workers then keep
        them per request."""
        return self.uses_penalty or any(len(word) > 1 for word in self.bad_words_ids)


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One output token's logprob and the top-N alternatives (best first), for a request that asks."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []
    rank: int = 1  # the token's place in the distribution, 1 = most likely (vLLM's: tokens at least as likely)


class LoRAAdapterSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One adapter to load, as clients name it."""

    lora_name: str
    lora_path: str
    pinned: bool | None = None  # None: False for a new adapter; an in-place reload keeps the adapter's own
    # speculative decoding (method draft_model): the draft model's adapter for this one, loaded with it on every rank
    # and dropped with it (SGLang's and vLLM's spelling); None: the --speculative-lora-modules namesake, if any
    draft_lora_path: str | None = None


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """One tensor of an adapter sent as raw bytes: its bytes ride in an extra frame (C order, little-endian)."""

    name: str  # PEFT's key, e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
    dtype: str  # one of TENSOR_DTYPES
    shape: list[int]


# dtype names of TensorSpec -> bytes per element
TENSOR_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class LoRAAdapterResult(msgspec.Struct, frozen=True, kw_only=True):
    lora_name: str
    success: bool
    error_message: str = ""
    # why it failed, one of protocol.errors.ADAPTER_ERROR_KINDS: it picks the HTTP status on both APIs
    error_kind: str = ""


# ---- public requests (HTTP, Engine and RPC all carry these) ------------------------------------


class GenerateReqInput(Struct, frozen=True):
    """The /generate body, single or batched, as the RPC carries it."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None  # one prompt, or a batch of prompts
    sampling_params: dict | None = None
    lora_path: str | dict | list[str | dict | None] | None = None  # an adapter's name, or a lora_mix object
    lora_scale: float | list[float | None] | None = None  # the adapter's strength, per item for a batch (None: 1)
    rid: str | list[str] | None = None
    stream: bool = False  # RPC: GenerateReqOutput chunks with finished=False, then one with finished=True
    return_logprob: bool | None = None
    top_logprobs_num: int | None = None
    logprob_start_len: int | None = None
    return_text_in_logprobs: bool | None = None
    priority: int | None = None


class GenerateReqOutput(Struct, frozen=True):
    outputs: list[dict] = []  # one /generate response object per item (a stream chunk: the items that changed)
    success: bool = True
    error_message: str = ""
    finished: bool = True  # False on every stream chunk but the last


class AbortReqInput(Struct, frozen=True):
    rid: str


class AbortReqOutput(Struct, frozen=True):
    success: bool  # False: no request with that rid was in flight
    rid: str
    message: str = ""


class LoadLoRAAdapterReqInput(Struct, frozen=True):
    adapters: list[LoRAAdapterSpec]
    load_inplace: bool = False


class LoadLoRAAdapterFromTensorsReqInput(Struct, frozen=True):
    """An adapter from tensors in memory (SGLang's load_lora_adapter_from_tensors). Over the RPC, each tensor's bytes
    follow the payload as one extra frame, in the order of `tensors`; answered by a LoadLoRAAdapterReqOutput."""

    lora_name: str
    config_dict: dict  # adapter_config.json's content
    tensors: list[TensorSpec]
    pinned: bool | None = None
    load_inplace: bool = False


class LoadLoRAAdapterReqOutput(Struct, frozen=True):
    success: bool
    error_message: str = ""
    results: list[LoRAAdapterResult] = []
    loaded_adapters: dict[str, str | None] = {}  # name -> path; None for an adapter loaded from tensors


class UnloadLoRAAdapterReqInput(Struct, frozen=True):
    lora_names: list[str]


class UnloadLoRAAdapterReqOutput(Struct, frozen=True):
    success: bool
    error_message: str = ""
    results: list[LoRAAdapterResult] = []
    loaded_adapters: dict[str, str | None] = {}


class ListLoRAAdaptersReqInput(Struct, frozen=True):
    pass


class ListLoRAAdaptersReqOutput(Struct, frozen=True):
    adapters: list[dict] = []


class RpcError(Struct, frozen=True):
    error_message: str


# ---- frontend <-> scheduler --------------------------------------------------------------------


class ImageInput(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One image of a prompt, as the model's image processor made it in the frontend (frontend/multimodal/); the
    workers' vision encoder turns it into num_tokens embeddings that replace its placeholder tokens."""

    offset: int  # index in the prompt's input_ids of its first placeholder token
    num_tokens: int  # its run of placeholder tokens: one per row the encoder outputs for it
    content_hash: str  # sha256 hex of pixel_values and grid_thw: the prefix cache's key for its positions
    pixel_values: bytes  # float32, row-major, of shape `shape`
    shape: list[int]  # Qwen-VL: (patches, channels * temporal_patch_size * patch_size**2)
    grid_thw: list[int] = []  # Qwen-VL: (temporal, height, width) in patches before merging; []: a fixed-size encoder


class TokenizedGenerateReq(Struct, frozen=True):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    lora_id: int | None = None  # None = base model
    lora_scale: float = 1.0  # the adapter's strength for this request, in [0, 4] (1 with no adapter)
    priority: int = 0  # --scheduling-policy priority: lower runs first (vLLM's); fcfs ignores it
    key_id: str | None = None  # the API key it came with, by id: fair sharing counts per (key, adapter)
    # The pooling runner's request (protocol/pooling.py): prefill only, nothing sampled; it ends after its prompt's
    # last pass with the pooled output in its one TokenDelta (`pooled`).
    pooling: bool = False
    # An encoder's (BERT) segment of each prompt token, as its tokenizer gives them for a pair (0: the first text,
    # 1: the second); []: all 0
    token_type_ids: list[int] = []
    # A vision-language model's prompt: its images, in prompt order, each over its run of placeholder tokens
    images: list[ImageInput] = []
    # Qwen-VL's rotary positions of the prompt's tokens (protocol/mrope.py): 3 rows (time, height, width) of
    # len(input_ids); []: 1-D positions. A token after the prompt at index i takes i + mrope_delta in every row.
    mrope_positions: list[list[int]] = []
    mrope_delta: int = 0


class AbortReq(Struct, frozen=True):
    rid: str


class SchedulerStatsReq(Struct, frozen=True):
    op_id: int


class InlineAdapter(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """An adapter's content sent along instead of a directory: the config, and the tensors whose bytes follow the
    LoadAdapters message as extra frames (every inline adapter's, in adapter order, each in `tensors` order)."""

    config: dict  # adapter_config.json's content
    tensors: list[TensorSpec]


class AdapterToLoad(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    lora_id: int  # minted once by the frontend's registry, never reused
    lora_name: str  # for messages and logs, and a draft model's adapter of the same name (speculative decoding)
    lora_path: str | None  # resolved directory; None when the adapter comes inline
    pinned: bool = False
    replaces: int | None = None  # in-place reload: the id whose pin moves to this one once it is loaded
    root: str | None = None  # every file read for it must resolve inside (--lora-path-root, --lora-resolver-dir)
    inline: InlineAdapter | None = None  # set exactly when lora_path is None
    draft_lora_path: str | None = None  # resolved directory of its draft model's adapter (LoRAAdapterSpec's)


def split_inline_frames(adapters: list[AdapterToLoad], frames: list) -> list[list]:
    """The extra frames of a LoadAdapters, per adapter (empty for a directory load); ValueError if the count is
    not the one the inline adapters' tensor lists say."""
    counts = [len(a.inline.tensors) if a.inline is not None else 0 for a in adapters]
    if sum(counts) != len(frames):
        raise ValueError(f"{len(frames)} tensor frames for {sum(counts)} tensors")
    out, start = [], 0
    for count in counts:
        out.append(frames[start : start + count])
        start += count
    return out


class AdapterOutcome(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    lora_id: int
    success: bool
    error_message: str = ""
    error_kind: str = ""
    lora_rank: int = 0  # the adapter's LoRA rank
    target_modules: list[str] = []
    dora: bool = False  # a DoRA adapter: its strength is fixed (no lora_scale, no lora_mix)


class LoadAdapters(Struct, frozen=True):
    """Frontend -> scheduler -> every rank's loader. Answered by one AdapterOpDone with the same op_id."""

    op_id: int
    adapters: list[AdapterToLoad]
    # --nnodes > 1: node 0 cut every inline tensor per TP rank (protocol/adapters/lora_shards.py). The extra frames are
    # then tp equal runs, rank r's the r-th, each laid out as split_inline_frames says; every TensorSpec names the whole
    # tensor. The scheduler sends each rank only its run.
    frames_per_rank: bool = False


def frames_of_rank(op: LoadAdapters, frames: list, tp_rank: int, tp_size: int) -> list:
    """The extra frames of `op` that TP rank `tp_rank` gets; none when their count does not split evenly (a
    malformed load, which the rank then refuses on the count)."""
    if not op.frames_per_rank:
        return frames
    if len(frames) % tp_size:
        return []
    per_rank = len(frames) // tp_size
    return frames[tp_rank * per_rank : (tp_rank + 1) * per_rank]


class AdapterReport(Struct, frozen=True):
    """One rank's answer to a LoadAdapters."""

    op_id: int
    tp_rank: int
    outcomes: list[AdapterOutcome]


class DropAdapters(Struct, frozen=True):
    """Forget adapters (unload, eviction, or rollback of a failed load). Frontend -> scheduler -> every rank."""

    op_id: int
    lora_ids: list[int]


class AdapterOpDone(Struct, frozen=True):
    """The scheduler's one reply to a LoadAdapters or DropAdapters: an outcome per adapter, in order."""

    op_id: int
    outcomes: list[AdapterOutcome]


class TokenDelta(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    rid: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (eos / stop token), "length", "abort", "error"
    error_message: str = ""
    logprobs: list[TokenLogprob] = []  # one per token id when the request asks for logprobs, else empty
    # the next prompt tokens' logprobs (logprob_start_len >= 0), in prompt order, each sent once
    prompt_logprobs: list[TokenLogprob] = []
    # the request's first delta only: the prompt tokens its first admission took from the prefix cache (whole pages)
    num_cached_prompt_tokens: int = 0
    pooled: bytes = b""  # a pooling request's output (its last delta): float32 values, little-endian


class TokenDeltas(Struct, frozen=True):
    deltas: list[TokenDelta]


class SpecCount(Struct, frozen=True, kw_only=True):
    """Speculative decoding's counts for one adapter's requests (lora_id None: the base model's), since start."""

    lora_id: int | None
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # ... and accepted
    num_verify_passes: int = 0  # request passes that verified drafts (each yields accepted + 1 tokens)


class SchedulerStats(Struct, frozen=True):
    op_id: int
    num_running: int
    num_waiting: int
    kv_usage: float  # 0..1
    running_lora_ids: list[int] = []
    waiting_lora_ids: list[int] = []
    slot_lora_ids: list[int] = []  # per device slot, -1 = empty
    prefix_cache_hit_tokens: int = 0  # since start, cumulative
    prefix_cache_queried_tokens: int = 0
    num_preemptions: int = 0
    num_loaded_adapters: int = 0  # adapter ids every rank of this scheduler holds
    num_state_slots: int = 0  # hybrid models: the linear-attention state slots (0 = none), and those free
    num_free_state_slots: int = 0
    num_state_snapshots: int = 0  # ... the prefix cache's state snapshots, and those neither kept nor being saved
    num_free_state_snapshots: int = 0
    spec: list[SpecCount] = []  # speculative decoding's counts per adapter since start (adapters that drafted)


class SlotsChanged(Struct, frozen=True):
    """The scheduler's device slot table after a step that changed it (-1 = empty): where requests go under
    --dp-size (frontend/cluster/router.py)."""

    slot_lora_ids: list[int]


class SchedulerReady(Struct, frozen=True):
    max_total_tokens: int
    context_length: int
    vocab_size: int
    max_lora_rank: int = 0
    lora_target_modules: list[str] = []
    model_type: str = ""  # the HF model_type the workers run
    num_hidden_layers: int = 0  # after --hf-overrides
    grammar_error: str = ""  # why some rank cannot take structured output (xgrammar's import); "": every rank can
    kv_bytes_per_token: int = 0  # of one rank's KV cache, every layer
    service_cpu_cores: list[int] = []  # the cores the frontend keeps to (WorkerReady's); empty: not restricted


class ProcessFailed(Struct, frozen=True):
    who: str
    error_message: str


# ---- scheduler <-> workers ---------------------------------------------------------------------


class ForwardReq(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    input_ids: list[int]  # tokens new to the KV cache this step
    num_cached_tokens: int  # tokens of this request already in the KV cache
    page_ids: list[int]  # the request's page table, covering num_cached_tokens + len(input_ids)
    # Sent on a request's first pass after admission (so again after a preemption); each rank keeps it under req_key
    # until released_keys names the key. None: the rank's kept copy. A request without a req_key always carries it.
    sampling: SamplingParams | None = None
    num_generated: int = 0  # output tokens so far: with the seed, it makes sampling reproducible and stateless
    slot: int = -1  # adapter device slot, -1 = base model
    prev_row: int = -1  # >= 0: input_ids[0] is the token the previous batch sampled at this row (not known here yet)
    # Per-request state on the workers (the sampling parameters; penalties read the tokens so far; rank 0 keeps a
    # grammar matcher): a key unique over the scheduler's life, and, on the first pass after the request is
    # admitted, the tokens of its num_cached_tokens cached positions (penalties only).
    req_key: int = -1
    history_ids: list[int] | None = None
    # Prompt logprobs: the prompt tokens whose logprobs this pass computes, the first predicted by input row
    # prompt_logprob_row (the logits at position p give the logprob of the token at p + 1).
    prompt_logprob_ids: list[int] = []
    prompt_logprob_row: int = 0
    # longrope models (WorkerReady.long_rope_len): every position of this request takes the long factors, as
    # transformers gives them to a sequence longer than the original length; False: the short ones.
    long_rope: bool = False
    # Hybrid models (WorkerReady.num_state_slots > 0): the request's state slot, which holds its linear-attention
    # layers' recurrent and conv states; a pass with num_cached_tokens == 0 starts them from zero. -1: none.
    state_slot: int = -1
    # Hybrid models' prefix cache (WorkerReady.num_state_snapshots): a pass with num_cached_tokens > 0 and
    # restore_snapshot >= 0 first copies that snapshot (the states saved at position num_cached_tokens) into the
    # slot. Each (position, snapshot) of snapshot_saves: after the tokens before that position (one of this pass's,
    # its last included), the slot's states are copied into the snapshot.
    restore_snapshot: int = -1
    snapshot_saves: list[tuple[int, int]] = []
    lora_scale: float = 1.0  # the request's strength: multiplies its adapter's term (the slot's scaling too)
    # A pooling request's pass that reaches its prompt's end: the row returns its pooled output (BatchResult.pooled)
    # instead of a sampled token; `sampling` is not read.
    pool: bool = False
    # An encoder's (BERT) segment of each input token: 0 for a single text or a pair's first, 1 for its second
    # (a cross-encoder's query | document); []: all 0
    token_type_ids: list[int] = []
    # Speculative decoding: the last num_draft_tokens of input_ids are draft tokens (never prev_row's); the pass
    # verifies them and returns the accepted ones (BatchResult.accepted_ids) before its sampled token.
    num_draft_tokens: int = 0
    # Speculative decoding with a draft model (method draft_model): the workers' draft model proposes this many
    # tokens after input_ids (pages cover them), which the pass then verifies as drafts.
    num_model_drafts: int = 0
    # A vision-language model's request: the images whose placeholder runs overlap this pass's tokens (offsets in
    # the prompt; the worker encodes each whole and takes the rows that fall in this pass), and this pass's tokens'
    # M-RoPE positions (3 rows of len(input_ids); [] with mrope_delta != 0: token index + mrope_delta in every row).
    images: list[ImageInput] = []
    mrope_positions: list[list[int]] = []
    mrope_delta: int = 0


class SlotLoad(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    slot: int
    lora_id: int  # -1 clears the slot


class ForwardBatch(Struct, frozen=True):
    batch_id: int
    reqs: list[ForwardReq]
    slot_loads: list[SlotLoad] = []  # applied before the forward pass
    released_keys: list[int] = []  # requests that ended: the workers forget their state (req_key)


class BatchResult(Struct, frozen=True):
    batch_id: int
    next_token_ids: list[int]
    error_message: str = ""
    # per row: the sampled token's logprob data where the row's sampling asks for it (else None); empty: none asked
    logprobs: list[TokenLogprob | None] = []
    prompt_logprobs: list[list[TokenLogprob]] = []  # per row, for its prompt_logprob_ids; empty: no row asked
    # per row: its pooled output (ForwardReq.pool) as float32 bytes, little-endian, else b""; empty: no row pools
    pooled: list[bytes] = []
    # Speculative decoding, per row: its draft tokens the pass accepted, which come before next_token_ids[row] (the
    # token sampled where the first draft was rejected, or after the last); empty: no row accepted any.
    accepted_ids: list[list[int]] = []
    # ... and their logprob data, per row that asks for logprobs (logprobs[row] is then its sampled token's); empty
    # when no row has both
    accepted_logprobs: list[list[TokenLogprob]] = []


class WorkerReady(Struct, frozen=True):
    tp_rank: int
    max_total_tokens: int
    context_length: int
    vocab_size: int
    max_lora_rank: int = 0
    lora_target_modules: list[str] = []
    device_type: str = "cpu"  # "cpu" or "cuda": picks defaults that depend on the device
    model_type: str = ""  # the HF model_type this rank runs
    num_hidden_layers: int = 0  # after --hf-overrides
    # The most tokens any layer's query attends to when every layer has a sliding window (ModelConfig's); None = some
    # layer attends to the whole context. The scheduler gives back pages behind it.
    attention_window: int | None = None
    # longrope models: a request whose sequence grows past this length is recomputed with the long factors
    # (ForwardReq.long_rope); 0: no such length within the context
    long_rope_len: int = 0
    grammar_error: str = ""  # why this rank cannot take structured output (xgrammar's import); "": it can
    kv_bytes_per_token: int = 0  # of this rank's KV cache, every layer (latent attention: the latent and rope key)
    # Hybrid models (linear-attention layers beside attention): the state slots the scheduler hands out, one per
    # running request; 0 = no such layers. And the state snapshots (ForwardReq.restore_snapshot, snapshot_saves) the
    # prefix cache keeps at cached page boundaries; 0 = none, so no prefix caching.
    num_state_slots: int = 0
    num_state_snapshots: int = 0
    # The cores the frontend and the scheduler keep to, off this rank's pinned compute threads (protocol/cpu_cores.py);
    # empty: not restricted
    service_cpu_cores: list[int] = []
    # The pooling runner (protocol/pooling.py) runs: its default prefill budget is larger (chunked_prefill_tokens)
    is_pooling: bool = False
    # The pooling runner's requests' prompts run whole from position 0 (PoolingSpec.whole_prompt)
    pools_whole_prompt: bool = False
    # An image's placeholder run attends both ways in prefill (Gemma 3; Gemma 4 with use_bidirectional_attention
    # "vision"): a chunk never ends inside one (scheduler/image_runs.py)
    images_whole: bool = False


class Shutdown(Struct, frozen=True):
    pass


# ---- process start-up ---------------------------------------------------------------------------


class Endpoints(msgspec.Struct, frozen=True, kw_only=True):
    frontend_to_scheduler: str
    scheduler_to_frontend: str
    scheduler_to_workers: list[str]  # one per local rank
    workers_to_scheduler: str
    dist_init_addr: str  # host:port of the torch.distributed rendezvous
    # One per local rank: adapter loads go straight to each rank's loader thread, even mid forward pass.
    scheduler_to_loaders: list[str]


class ProcessArgs(msgspec.Struct, frozen=True, kw_only=True):
    config: ServerConfig
    endpoints: Endpoints
    model_dir: str  # resolved checkpoint directory
    local_rank: int = 0  # the worker's rank on its node; unused by the scheduler
    dp_rank: int = 0  # the data-parallel replica this process belongs to (--dp-size)


# ---- one union per socket direction ---------------------------------------------------------------

FrontendToScheduler = Union[TokenizedGenerateReq, AbortReq, LoadAdapters, DropAdapters, SchedulerStatsReq, Shutdown]
SchedulerToFrontend = Union[TokenDeltas, SlotsChanged, SchedulerReady, SchedulerStats, AdapterOpDone, ProcessFailed]
SchedulerToWorker = Union[ForwardBatch, DropAdapters, Shutdown]
SchedulerToLoader = LoadAdapters
WorkerToScheduler = Union[BatchResult, AdapterReport, WorkerReady, ProcessFailed]
RpcRequest = Union[
    GenerateReqInput,
    AbortReqInput,
    LoadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqInput,
    ListLoRAAdaptersReqInput,
    LoadLoRAAdapterFromTensorsReqInput,
]
RpcReply = Union[
    GenerateReqOutput,
    AbortReqOutput,
    LoadLoRAAdapterReqOutput,
    UnloadLoRAAdapterReqOutput,
    ListLoRAAdaptersReqOutput,
    RpcError,
]
