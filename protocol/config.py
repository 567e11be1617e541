"""The one server configuration: every launch setting with its help, validated once. The command line
(frontend/entrypoints/cli.py) is generated from it; the Engine's keywords arrive through `from_kwargs`."""

from __future__ import annotations

import os
import socket
from typing import Annotated, Any, Literal

import msgspec
from loraplex.protocol.adapters.lora_targets import ALL_TARGETS, LAYER_MODULES
from loraplex.protocol.model_ref import ModelRef, parse_model_ref
from loraplex.protocol.speculative import SpeculativeConfig, SpeculativeConfigError, speculative_config
from msgspec import Meta


class ConfigError(ValueError):
    pass


class LoRASource(msgspec.Struct, frozen=True, kw_only=True):
    lora_name: str
    lora_path: str
    pinned: bool = False
    base_model_name: str | None = None  # --lora-modules: the card's `parent` in /v1/models


class _VllmLoRAModule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_source(text: str) -> LoRASource:
    """`--lora-paths` entry: `NAME=PATH`, `PATH` (named after its directory) or JSON."""
    text = text.strip()
    if text.startswith("{"):
        try:
            return msgspec.json.decode(text.encode(), type=LoRASource)
        except msgspec.ValidationError as e:
            raise ConfigError(f"bad --lora-paths JSON {text!r}: {e}") from e
        except msgspec.DecodeError as e:
            raise ConfigError(f"bad --lora-paths JSON {text!r}: {e}") from e
    if "=" in text:
        name, path = text.split("=", 1)
        return LoRASource(lora_name=name, lora_path=path)
    return LoRASource(lora_name=os.path.basename(os.path.normpath(text)), lora_path=text)


def parse_lora_module(text: str) -> LoRASource:
    """`--lora-modules` entry (vLLM's): `NAME=PATH` or JSON {"name", "path", "base_model_name"}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            module = msgspec.json.decode(text.encode(), type=_VllmLoRAModule)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ConfigError(f"bad --lora-modules JSON {text!r}: {e}") from e
        return LoRASource(lora_name=module.name, lora_path=module.path, base_model_name=module.base_model_name)
    if "=" not in text:
        raise ConfigError(f"bad --lora-modules entry {text!r}: expected NAME=PATH or JSON")
    name, path = text.split("=", 1)
    return LoRASource(lora_name=name, lora_path=path)


def interface_names() -> list[str]:
    """This host's network interfaces, as --dist-interface names them."""
    return sorted(name for _, name in socket.if_nameindex())


def is_loopback_address(addr: str) -> bool:
    """ipc:// and inproc:// paths, and TCP on 127.0.0.0/8, [::1] or localhost."""
    if not addr.startswith("tcp://"):
        return True
    host = addr[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def is_loopback_host(host: str) -> bool:
    """An HTTP --host that only this machine reaches: 127.0.0.0/8, ::1 or localhost."""
    return is_loopback_address(f"tcp://{host}:0")


# vLLM's and SGLang's spellings of our flags, with their meaning there: alias -> field. Giving both spellings is an
# error. docs/API.md's flag tables say where a meaning differs in detail.
ALIASES: dict[str, str] = {
    "model": "model_path",  # vLLM
    "tensor_parallel_size": "tp",  # vLLM and SGLang
    "tp_size": "tp",  # SGLang
    "data_parallel_size": "dp_size",  # vLLM and SGLang
    "max_model_len": "context_length",  # vLLM
    "max_loras": "max_loras_per_batch",  # vLLM
    "max_cpu_loras": "max_loaded_loras",  # vLLM
    "max_num_seqs": "max_running_requests",  # vLLM
    "max_num_batched_tokens": "chunked_prefill_size",  # vLLM (it counts decode tokens too; we count prompt tokens)
    "enforce_eager": "disable_cuda_graph",  # vLLM
    "mem_fraction_static": "gpu_memory_utilization",  # SGLang: weights and KV cache, as ours
    "block_size": "page_size",  # vLLM: tokens per KV cache block
    "random_seed": "seed",  # SGLang
    "tokenizer_path": "tokenizer",  # SGLang
}
# Their names for our choices: field -> {their value: ours}.
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "dtype": {"half": "float16", "float": "float32"},  # vLLM and SGLang
    "lora_backend": {"csgmv": "triton", "torch_native": "torch"},  # SGLang's CUDA kernels and torch ops
    "attention_backend": {"torch_native": "torch"},  # SGLang
    "tool_call_parser": {  # SGLang's, and vLLM's deepseek_v31 (deepseek_v3 reads V3.1's calls too)
        "llama3": "llama3_json", "qwen25": "hermes", "qwen": "hermes", "deepseekv3": "deepseek_v3",
        "deepseekv31": "deepseek_v3", "deepseek_v31": "deepseek_v3", "gpt-oss": "openai",
    },
    "reasoning_parser": {  # SGLang
        "deepseek-r1": "deepseek_r1", "deepseek-v3": "deepseek_v3", "gpt-oss": "openai_gptoss",
    },
}
DEFAULT_LORA_RANK = 16  # --enable-lora with nothing to infer the pool from (vLLM's default; all seven modules)


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Each field's description is its flag's help in `loraplex --help` (and its description in the JSON schema).
    model_path: Annotated[str, Meta(description=
        "a Hugging Face checkpoint: a local dir, or a Hub id ORG/NAME[@REVISION] downloaded once into --download-dir "
        "(a local dir of that name wins); 'demo' = the shipped demo (adapters: reverse, sort, mirror)"
    )] = "demo"
    served_model_name: Annotated[str | None, Meta(description=
        "base model name in the OpenAI API (default: the Hub id, or the last path component)"
    )] = None
    revision: Annotated[str | None, Meta(description=
        "the Hub revision of the model: a branch, tag or commit; none = the default branch"
    )] = None
    tokenizer: Annotated[str | None, Meta(description="the tokenizer's Hub id or dir; none = the model's")] = None
    tokenizer_revision: Annotated[str | None, Meta(description="the Hub revision of --tokenizer")] = None
    download_dir: Annotated[str | None, Meta(description=
        "where Hub models are downloaded; none = the Hugging Face cache (HF_HUB_CACHE / HF_HOME), shared with other "
        "tools"
    )] = None
    hf_token: Annotated[str | None, Meta(description=
        "Hub token for gated or private models; none = HF_TOKEN, or the token `hf auth login` saved"
    )] = None
    load_format: Annotated[Literal["auto", "safetensors", "dummy"], Meta(description=
        "where the weights come from: auto or safetensors (the checkpoint's *.safetensors files), dummy (random "
        "weights on the checkpoint's config.json, weight files or not: benchmarks and tests at real shapes)"
    )] = "auto"
    hf_overrides: Annotated[dict[str, Any], Meta(description=
        "JSON object merged into the model's config.json before anything reads it, e.g. '{\"num_hidden_layers\": 2}' "
        "(nested objects merge key by key)"
    )] = {}
    allowed_local_media_path: Annotated[str | None, Meta(description=
        "images may be given as file:// paths that resolve (symlinks followed) inside this directory; unset: none"
    )] = None
    limit_mm_per_prompt: Annotated[dict[str, Any], Meta(description=
        "JSON object: the most items of each modality in one prompt, e.g. '{\"image\": 2}' (default 4 images)"
    )] = {}
    host: Annotated[str, Meta(description="HTTP bind address")] = "127.0.0.1"
    port: Annotated[int, Meta(description="HTTP port")] = 30000
    tp: Annotated[int, Meta(description="tensor-parallel worker processes")] = 1
    enable_expert_parallel: Annotated[bool, Meta(description=
        "MoE models: shard the routed experts by expert over the --tp ranks (each holds experts / tp of them whole, "
        "with their adapters' weights; tokens go to their experts' ranks and back by all-to-all) instead of every "
        "expert by rows; attention, dense MLPs and shared experts stay tensor-parallel. --tp must divide the experts"
    )] = False
    device: Annotated[Literal["cpu", "cuda"] | None, Meta(description=
        "cpu or cuda (default: cuda if available)"
    )] = None
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], Meta(description=
        "auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16 or float16"
    )] = "auto"
    quantization: Annotated[Literal["auto", "fp8", "compressed-tensors", "gptq", "awq", "mxfp4", "none"], Meta(
        description=
        "the checkpoint's quantization (vLLM's names): auto = as config.json's quantization_config says; a named "
        "method must match it; none = plain weights (docs/QUANTIZATION.md)"
    )] = "auto"
    enable_lora: Annotated[bool, Meta(description="turn LoRA on (implied by --lora-paths)")] = False
    enable_tower_connector_lora: Annotated[bool, Meta(description=
        "adapters may also target a vision-language model's vision tower and its merger (PEFT's names, e.g. "
        "visual.blocks.0.attn.qkv, visual.merger.mlp.0): each image is encoded with its request's adapter; without "
        "it such an adapter is refused"
    )] = False
    lora_backend: Annotated[Literal["auto", "triton", "cpu", "torch"], Meta(description=
        "LoRA kernels: triton (CUDA), cpu (compiled AVX-512 BF16 kernels; bfloat16 on the CPU, also used for attention "
        "and norms), torch (torch ops, any device); auto = triton on CUDA, else cpu where it builds and runs, else "
        "torch"
    )] = "auto"
    attention_backend: Annotated[Literal["auto", "triton", "cpu", "torch"], Meta(description=
        "attention kernels: triton (paged Triton kernels reading K/V from the cache pages in place; CUDA), cpu "
        "(decodes in the compiled CPU kernels, prefills in SDPA; needs --lora-backend cpu or auto to build them), "
        "torch (SDPA over gathered pages); auto = triton on CUDA, else cpu where the CPU kernels run and take the "
        "model's head shapes, else torch"
    )] = "auto"
    enable_cuda_graph: Annotated[bool, Meta(description=
        "capture decode steps as CUDA graphs at start-up, one per batch size of a ladder up to --cuda-graph-max-bs, "
        "and replay them (CUDA, --attention-backend triton; ignored on a CPU, with a log line)"
    )] = False
    disable_cuda_graph: Annotated[bool, Meta(description=
        "SGLang's switch: decode runs eagerly (the default until a GPU run confirms the graphs)"
    )] = False
    cuda_graph_max_bs: Annotated[int | None, Meta(description=
        "largest decode batch replayed from a CUDA graph (default: --max-running-requests); larger batches run eagerly"
    )] = None
    lora_paths: Annotated[list[str], Meta(description=
        "adapters loaded at start: NAME=PATH, PATH, or JSON {lora_name, lora_path, pinned}"
    )] = []
    max_loras_per_batch: Annotated[int, Meta(description=
        "device adapter slots = most distinct adapters in one forward pass"
    )] = 8
    max_loaded_loras: Annotated[int | None, Meta(description=
        "adapters kept in host memory (LRU beyond it); default unlimited"
    )] = None
    lora_drain_timeout: Annotated[float, Meta(description=
        "seconds an unload waits for the adapter's running requests"
    )] = 120.0
    max_lora_rank: Annotated[int | None, Meta(description="largest adapter rank the device pool holds")] = None
    max_full_module_copies: Annotated[int, Meta(description=
        "adapters that may hold full copies of embed_tokens / lm_head (PEFT modules_to_save) at once, each "
        "vocab x hidden per module on every rank; 0 refuses such adapters"
    )] = 2
    lora_target_modules: Annotated[list[str] | None, Meta(description=
        "modules the device pool covers (names or 'all': the decoder layers' seven linears; embed_tokens and lm_head "
        "by name)"
    )] = None
    lora_path_root: Annotated[str | None, Meta(description=
        "when set, lora_path must resolve inside this directory"
    )] = None
    api_key: Annotated[str | None, Meta(description="bearer key for every endpoint but /health")] = None
    admin_api_key: Annotated[str | None, Meta(description="bearer key for adapter load/unload")] = None
    rpc_addr: Annotated[str | None, Meta(description=
        "ZeroMQ address of the internal RPC endpoint (tcp://host:port or ipc://path)"
    )] = None
    max_running_requests: Annotated[int, Meta(description="most requests decoding at once")] = 64
    max_total_tokens: Annotated[int | None, Meta(description=
        "KV cache capacity in tokens (default: sized from the context length)"
    )] = None
    context_length: Annotated[int | None, Meta(description=
        "longest prompt + output (default: the model's max_position_embeddings)"
    )] = None
    max_prefill_tokens: Annotated[int, Meta(description="most prompt tokens prefilled in one forward pass")] = 8192
    page_size: Annotated[int, Meta(description="tokens per KV cache page")] = 16
    seed: Annotated[int, Meta(description="random seed for sampling without a per-request seed")] = 0
    log_level: Annotated[Literal["debug", "info", "warning", "error"], Meta(description="logging level")] = "info"
    nnodes: Annotated[int, Meta(description="nodes for multi-node tensor parallelism")] = 1
    node_rank: Annotated[int, Meta(description="this node's rank")] = 0
    dist_init_addr: Annotated[str | None, Meta(description=
        "host:port of the torch.distributed rendezvous; with --nnodes > 1 the one address every node agrees on, hosted "
        "by node 0 (default: a free local port)"
    )] = None
    dist_interface: Annotated[str | None, Meta(description=
        "network interface the collectives' own connections use (gloo's and NCCL's sockets: GLOO_SOCKET_IFNAME, "
        "NCCL_SOCKET_IFNAME); their tensors travel unencrypted, so name a private network's interface"
    )] = None
    lora_load_timeout: Annotated[float, Meta(description=
        "seconds an adapter operation waits for every rank before it fails and is rolled back"
    )] = 60.0
    lora_state_file: Annotated[str | None, Meta(description=
        "adapter registry file, rewritten after every change and restored at start"
    )] = None
    lora_resolver_dir: Annotated[str | None, Meta(description=
        "an unknown adapter X named by a request is loaded from DIR/X on first use (DIR may also be s3://bucket/prefix "
        "or hf://org)"
    )] = None
    lora_cache_dir: Annotated[str | None, Meta(description=
        "where Hub and S3 adapters are downloaded (default: ~/.cache/loraplex/adapters)"
    )] = None
    lora_cache_max_gb: Annotated[float, Meta(description=
        "size cap of --lora-cache-dir in GB; past it the least recently used adapters are deleted"
    )] = 20.0
    disable_lora_updates: Annotated[bool, Meta(description=
        "serve the start-up adapters only: every load/unload after start is refused (403)"
    )] = False
    shutdown_timeout: Annotated[float, Meta(description=
        "seconds in-flight requests may run after SIGTERM before they are aborted"
    )] = 20.0
    dist_timeout: Annotated[float, Meta(description=
        "seconds before a collective times out once serving (a backstop)"
    )] = 30.0
    chunked_prefill_size: Annotated[int | None, Meta(description=
        "most prompt tokens one forward pass takes, summed over requests; -1 = whole prompts (default: 2048 on CUDA, "
        "512 on CPU; the pooling runner's: --max-prefill-tokens)"
    )] = None
    disable_radix_cache: Annotated[bool, Meta(description="turn off the prefix cache (keyed by adapter)")] = False
    no_enable_prefix_caching: Annotated[bool, Meta(description="vLLM's spelling of --disable-radix-cache")] = False
    dp_size: Annotated[int, Meta(description=
        "data-parallel replicas behind one frontend, each a scheduler and --tp workers"
    )] = 1
    gpu_memory_utilization: Annotated[float | None, Meta(description=
        "share of the GPU's memory this server may use, KV cache included (CUDA; default: the KV cache takes 0.85 of "
        "what is free after the weights)"
    )] = None
    lora_modules: Annotated[list[str], Meta(description=
        "vLLM's adapters loaded at start: NAME=PATH or JSON {name, path, base_model_name}"
    )] = []
    reasoning_parser: Annotated[
        Literal["deepseek_r1", "qwen3", "glm45", "openai_gptoss", "deepseek_v3"] | None, Meta(description=
        "chat answers put the model's <think>...</think> text in reasoning_content: deepseek_r1 (the template opened "
        "<think>), qwen3 / glm45 (reasoning only where the output opens <think>) or deepseek_v3 (as deepseek_r1 with "
        "chat_template_kwargs.thinking true, else none); a structured-output constraint then applies after </think>; "
        "openai_gptoss (gpt-oss's harmony): the analysis channel is the reasoning, the final channel the content"
    )] = None
    chat_template: Annotated[str | None, Meta(description=
        "chat template for /v1/chat/completions: a file, or inline Jinja (default: the tokenizer's)"
    )] = None
    enable_auto_tool_choice: Annotated[bool, Meta(description=
        "tool_choice auto: the model's text is read for tool calls (needs --tool-call-parser)"
    )] = False
    tool_call_parser: Annotated[
        Literal["hermes", "llama3_json", "mistral", "qwen3_coder", "xml", "pythonic", "glm45", "openai", "deepseek_v3",
                "kimi_k2", "llama4_pythonic"] | None,
        Meta(description=
        "the format of the model's tool calls (tool_choice auto); required and named choices are forced by a grammar "
        "and need none"
    )] = None
    max_running_per_adapter: Annotated[int | None, Meta(description=
        "most requests of one adapter running at once (default unlimited)"
    )] = None
    disable_adapter_fairness: Annotated[bool, Meta(description=
        "admit waiting requests first come, first served rather than by fair share between adapters (virtual token "
        "counters, per API key and adapter)"
    )] = False
    scheduling_policy: Annotated[Literal["fcfs", "priority"], Meta(description=
        "fcfs: waiting requests run by arrival (fair between adapters unless --disable-adapter-fairness); priority: by "
        "the request's `priority` (lower first), then as fcfs; a preemption then takes the lowest priority first"
    )] = "fcfs"
    max_requests_per_minute_per_key: Annotated[int | None, Meta(description=
        "requests one API key may start per minute; past it 429 with Retry-After (needs --api-key)"
    )] = None
    max_tokens_per_minute_per_key: Annotated[int | None, Meta(description=
        "prompt + output tokens one API key may use per minute; past it 429 with Retry-After (needs --api-key)"
    )] = None
    allow_unauthenticated_lora_updates: Annotated[bool, Meta(description=
        "allow run-time adapter loads and unloads on a non-loopback --host without --api-key or --admin-api-key (off "
        "by default: updates are refused with 403 updates_disabled)"
    )] = False
    cluster_key_file: Annotated[str | None, Meta(description=
        "CURVE key file (written by `loraplex keygen PATH`): encrypts and authenticates every TCP ZeroMQ socket "
        "between nodes and a TCP --rpc-addr; required with --nnodes > 1 or a non-loopback TCP --rpc-addr"
    )] = None
    audit_log: Annotated[str | None, Meta(description=
        "file that gets one JSON line per adapter operation or refusal (rotated at 100 MB)"
    )] = None
    lora_allow_base_mismatch: Annotated[bool, Meta(description=
        "load an adapter whose base_model_name_or_path names another model (with a warning); without it only an "
        "adapter for another Hub model (family, version or size) is refused"
    )] = False
    lora_strict_base_match: Annotated[bool, Meta(description=
        "refuse an adapter whose base_model_name_or_path does not name the served model, also where the names cannot "
        "tell (a local path, a re-uploader's spelling); without it those load with a warning"
    )] = False
    lora_require_manifest: Annotated[bool, Meta(description=
        "an adapter needs loraplex-manifest.json (SHA-256 of every file read), checked before any rank reads it"
    )] = False
    max_mamba_cache_size: Annotated[int | None, Meta(description=
        "state slots of a hybrid model's linear-attention layers (one per running request; default: "
        "--max-running-requests)"
    )] = None
    max_state_snapshots: Annotated[int | None, Meta(description=
        "snapshots of a hybrid model's linear-attention states that its prefix cache keeps at cached page boundaries "
        "(a hit restores one; each the size of a state slot; 0: no prefix caching for these models; default: as "
        "many as state slots)"
    )] = None
    mamba_ssm_cache_dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], Meta(description=
        "dtype of a hybrid model's recurrent and conv states (auto: the checkpoint's mamba_ssm_dtype, else the model's)"
    )] = "auto"
    runner: Annotated[Literal["auto", "generate", "pooling"], Meta(description=
        "generate (text) or pooling (embeddings, scores, classes: /v1/embeddings, /pooling, /score, /rerank, "
        "/classify); auto = pooling for a *ForSequenceClassification or sentence-transformers checkpoint, or when "
        "--convert, --task or --is-embedding asks for it, else generate"
    )] = "auto"
    convert: Annotated[Literal["auto", "none", "embed", "classify"], Meta(description=
        "pooling runner: embed (pooled, normalised hidden states) or classify (the score head's, or with "
        "classifier_from_token in --hf-overrides the LM head's token logits); auto = as the checkpoint says"
    )] = "auto"
    task: Annotated[Literal["generate", "embed", "score", "classify"] | None, Meta(description=
        "vLLM's older spelling of --runner/--convert: embed, score or classify run the pooling runner"
    )] = None
    is_embedding: Annotated[bool, Meta(description=
        "SGLang's switch for the pooling runner (embed unless the checkpoint is a classifier)"
    )] = False

    kv_cache_dtype: Annotated[Literal["auto", "bfloat16", "fp8", "fp8_e4m3"], Meta(description=
        "dtype of the KV cache (vLLM): auto = the model's (--dtype); fp8 = fp8_e4m3 (float8_e4m3fn with one scale per "
        "layer for keys and one for values, from the checkpoint's k_scale/v_scale, computed with "
        "--calculate-kv-scales, else 1.0), half the bytes per token of bfloat16 and so twice the tokens"
    )] = "auto"
    calculate_kv_scales: Annotated[bool, Meta(description=
        "an FP8 KV cache's scales from the first prefill's largest keys and values (vLLM), fixed after; without it "
        "the checkpoint's k_scale/v_scale, else 1.0"
    )] = False

    speculative_config: Annotated[dict[str, Any], Meta(description=
        "speculative decoding (vLLM's JSON): {\"method\": \"ngram\", \"num_speculative_tokens\": K, "
        "\"prompt_lookup_min\": N, \"prompt_lookup_max\": M} drafts up to K tokens from each request's own tokens; "
        "{\"method\": \"draft_model\", \"model\": DIR, \"num_speculative_tokens\": K} from a small model with the "
        "target's tokenizer; {\"method\": \"eagle3\", \"model\": HEAD_DIR, ...} from an EAGLE-3 head reading the "
        "target's hidden states; the target verifies them in one pass on the request's adapter"
    )] = {}
    speculative_algorithm: Annotated[str | None, Meta(description=
        "SGLang's spelling of --speculative-config's method: NGRAM, STANDALONE (draft_model), EAGLE3 (eagle3)"
    )] = None
    speculative_draft_model_path: Annotated[str | None, Meta(description=
        "SGLang's spelling of --speculative-config's model (the draft model's or EAGLE-3 head's local directory)"
    )] = None
    speculative_num_draft_tokens: Annotated[int | None, Meta(description=
        "SGLang's spelling of --speculative-config's num_speculative_tokens (default 4)"
    )] = None
    speculative_lora_modules: Annotated[list[str], Meta(description=
        "draft-model adapters NAME=PATH (or --lora-modules' JSON), loaded at start: a request on adapter NAME drafts "
        "with draft adapter NAME, one on an adapter without a draft counterpart with the bare draft model; with "
        "eagle3, NAME=HEAD_DIR is adapter NAME's own EAGLE-3 head (the others use the base head)"
    )] = []

    def __post_init__(self) -> None:
        positive = (
            "port",
            "tp",
            "max_loras_per_batch",
            "max_running_requests",
            "max_prefill_tokens",
            "page_size",
            "nnodes",
            "dp_size",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("max_loaded_loras", "max_lora_rank", "max_total_tokens", "context_length", "cuda_graph_max_bs",
                     "max_running_per_adapter", "max_requests_per_minute_per_key", "max_tokens_per_minute_per_key",
                     "max_mamba_cache_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.max_full_module_copies < 0:
            raise ConfigError(f"--max-full-module-copies must be >= 0, got {self.max_full_module_copies}")
        if self.max_state_snapshots is not None and self.max_state_snapshots < 0:
            raise ConfigError(f"--max-state-snapshots must be >= 0, got {self.max_state_snapshots}")
        for name in ("lora_drain_timeout", "lora_load_timeout", "dist_timeout", "lora_cache_max_gb"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            raise ConfigError(f"--chunked-prefill-size must be >= 1 or -1 (off), got {self.chunked_prefill_size}")
        if self.dp_size > 1 and self.nnodes > 1:
            raise ConfigError("--dp-size > 1 with --nnodes > 1 is not supported: replicas run on one node")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.calculate_kv_scales and not self.kv_cache_is_fp8:
            raise ConfigError("--calculate-kv-scales sets the scales of an FP8 KV cache: it needs --kv-cache-dtype fp8")
        for modality, limit in self.limit_mm_per_prompt.items():
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise ConfigError(f"--limit-mm-per-prompt's {modality!r} must be an int >= 0, got {limit!r}")
            if modality != "image" and limit:  # vLLM's other modalities are accepted at 0, which is what is served
                raise ConfigError(f"--limit-mm-per-prompt: only images are served here; {modality!r} must be 0")
        if self.enable_cuda_graph and self.disable_cuda_graph:
            raise ConfigError("--enable-cuda-graph and --disable-cuda-graph contradict each other: give one")
        if self.shutdown_timeout < 0:
            raise ConfigError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (the format of the model's calls)")
        if self.lora_allow_base_mismatch and self.lora_strict_base_match:
            raise ConfigError("--lora-allow-base-mismatch and --lora-strict-base-match contradict each other: give one")
        if self.disable_lora_updates and self.lora_resolver_dir:
            raise ConfigError("--lora-resolver-dir loads adapters at run time, which --disable-lora-updates forbids")
        if self.rpc_addr and not self.api_key and not is_loopback_address(self.rpc_addr):
            raise ConfigError(f"--rpc-addr {self.rpc_addr} is not loopback: set --api-key to open it")
        for name in ("max_requests_per_minute_per_key", "max_tokens_per_minute_per_key"):
            if getattr(self, name) is not None and not self.api_key:
                raise ConfigError(f"--{flag_name(name)} limits each API key: it needs --api-key")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} outside 0..{self.nnodes - 1}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("--nnodes > 1 needs --dist-init-addr HOST:PORT (the one address every node agrees on)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--dist-init-addr {self.dist_init_addr!r} is not HOST:PORT")
        if self.dist_interface is not None and self.dist_interface not in (names := interface_names()):
            raise ConfigError(f"--dist-interface {self.dist_interface}: no such network interface here (this host has "
                              f"{', '.join(names)})")
        if self.tp % self.nnodes:
            raise ConfigError(f"--tp {self.tp} is not divisible by --nnodes {self.nnodes}")
        needs_cluster_key = self.nnodes > 1 or (self.rpc_addr is not None and not is_loopback_address(self.rpc_addr))
        if needs_cluster_key and not self.cluster_key_file:
            why = "--nnodes > 1" if self.nnodes > 1 else f"--rpc-addr {self.rpc_addr} (not loopback)"
            raise ConfigError(f"{why} needs --cluster-key-file PATH (write one with `loraplex keygen PATH`)")
        if self.lora_target_modules is not None:
            for module in self.lora_target_modules:
                if module != "all" and module not in ALL_TARGETS:
                    raise ConfigError(f"unknown LoRA target module {module!r}; known: {', '.join(ALL_TARGETS)}")
        sources = self.lora_sources  # parses every entry
        names = [s.lora_name for s in sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"an adapter name appears twice in --lora-paths / --lora-modules: {names}")
        if self.tokenizer_revision is not None and self.tokenizer is None:
            raise ConfigError("--tokenizer-revision needs --tokenizer (the model's own tokenizer comes at --revision)")
        try:  # ORG/NAME@REV and another --revision
            self.model_ref, self.tokenizer_ref  # noqa: B018
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if self.max_loaded_loras is not None and self.max_loaded_loras < len(sources):
            raise ConfigError("--max-loaded-loras is smaller than the number of --lora-paths and --lora-modules")
        try:
            spec = self.speculation
        except SpeculativeConfigError as e:
            raise ConfigError(str(e)) from e
        if self.speculative_lora_modules and (spec is None or spec.method not in ("draft_model", "eagle3")):
            raise ConfigError("--speculative-lora-modules are a draft model's adapters or EAGLE-3 heads per adapter: "
                              "they need method draft_model or eagle3")
        draft_names = [s.lora_name for s in self.draft_lora_sources]  # parses every entry
        if len(set(draft_names)) != len(draft_names):
            raise ConfigError(f"a draft adapter name appears twice in --speculative-lora-modules: {draft_names}")

    @property
    def kv_cache_is_fp8(self) -> bool:
        return self.kv_cache_dtype in ("fp8", "fp8_e4m3")

    @property
    def cuda_graph_batch_sizes(self) -> list[int]:
        """The decode batch sizes captured as CUDA graphs ([] when off): powers of two, then the largest."""
        if not self.enable_cuda_graph:
            return []
        largest = min(self.cuda_graph_max_bs or self.max_running_requests, self.max_running_requests)
        sizes = [1]
        while sizes[-1] * 2 < largest:
            sizes.append(sizes[-1] * 2)
        return sizes if sizes[-1] == largest else [*sizes, largest]

    @property
    def speculation(self) -> SpeculativeConfig | None:
        """Speculative decoding's settings of either spelling (protocol/speculative.py), None when off."""
        return speculative_config(self.speculative_config, self.speculative_algorithm,
                                  self.speculative_draft_model_path, self.speculative_num_draft_tokens)  # fmt: skip

    @property
    def lora_updates_need_key(self) -> bool:
        """Safe default: beyond loopback, run-time adapter updates need a key, or an explicit opt-out."""
        return not (is_loopback_host(self.host) or self.api_key or self.admin_api_key
                    or self.allow_unauthenticated_lora_updates)

    @property
    def prefix_caching(self) -> bool:
        return not (self.disable_radix_cache or self.no_enable_prefix_caching)

    def chunked_prefill_tokens(self, device_type: str, is_pooling: bool = False) -> int:
        """The step's prefill token budget (-1 = off), defaulting by device; the pooling runner's is
        --max-prefill-tokens: with no decode rows to keep waiting, small chunks only cut a batch into more passes,
        each launching every op of the model again (vLLM's pooling default is large too)."""
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        if is_pooling:
            return self.max_prefill_tokens
        return 2048 if device_type == "cuda" else 512

    @property
    def image_limit(self) -> int:
        """--limit-mm-per-prompt's images per prompt (vLLM's JSON; default 4)."""
        return self.limit_mm_per_prompt.get("image", 4)

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_paths) or bool(self.lora_modules)

    @property
    def lora_sources(self) -> list[LoRASource]:
        """The start-up adapters: --lora-paths, then --lora-modules."""
        return [parse_lora_source(t) for t in self.lora_paths] + [parse_lora_module(t) for t in self.lora_modules]

    @property
    def draft_lora_sources(self) -> list[LoRASource]:
        """The draft model's adapters (--speculative-lora-modules), by the target adapters' names."""
        return [parse_lora_module(t) for t in self.speculative_lora_modules]

    @property
    def target_modules(self) -> tuple[str, ...] | None:
        if self.lora_target_modules is None:
            return None
        wanted = set(self.lora_target_modules) | (set(LAYER_MODULES) if "all" in self.lora_target_modules else set())
        # "all": a decoder layer's linears (the seven, and latent attention's where the model has it); the rest by name
        return tuple(m for m in ALL_TARGETS if m in wanted)

    @property
    def model_ref(self) -> ModelRef:
        """What --model-path names: a local dir, an HF-cache snapshot, or a Hub id (protocol/model_ref.py)."""
        return parse_model_ref(self.model_path, self.revision)

    @property
    def tokenizer_ref(self) -> ModelRef | None:
        """--tokenizer's, None when the tokenizer is the model's."""
        return None if self.tokenizer is None else parse_model_ref(self.tokenizer, self.tokenizer_revision)

    @property
    def model_name(self) -> str:
        """The served name: --served-model-name, else the Hub id (a snapshot's repo id), else the directory's name."""
        if self.served_model_name:
            return self.served_model_name
        return self.model_ref.repo_id or os.path.basename(os.path.normpath(self.model_path))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerConfig:
        """Build from Python values (the Engine's keywords, vLLM's spellings included), with the same validation as
        the CLI."""
        kwargs = dict(kwargs)
        for alias, name in ALIASES.items():
            if alias not in kwargs:
                continue
            if name in kwargs:
                raise ConfigError(f"--{flag_name(alias)} and --{flag_name(name)} are the same setting: give only one")
            kwargs[name] = kwargs.pop(alias)
        for name, values in VALUE_ALIASES.items():
            if kwargs.get(name) in values:
                kwargs[name] = values[kwargs[name]]
        unknown = set(kwargs) - set(cls.__struct_fields__)
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(sorted(unknown))}")
        try:
            return msgspec.convert(kwargs, cls)
        except msgspec.ValidationError as e:
            raise ConfigError(str(e)) from e


def flag_name(name: str) -> str:
    """A field's flag without its dashes: model_path -> model-path."""
    return name.replace("_", "-")
