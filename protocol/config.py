"""The one server configuration: every launch flag, validated once, and the CLI generated from it."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Literal, NoReturn

import msgspec
from loraplex.protocol.foreign_flags import FOREIGN_BY_DEST, FOREIGN_FLAGS
from loraplex.protocol.lora_targets import ALL_TARGETS, LAYER_MODULES
from loraplex.protocol.model_ref import ModelRef, parse_model_ref


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


def is_loopback_address(addr: str) -> bool:
    """ipc:// and inproc:// paths, and TCP on 127.0.0.0/8, [::1] or localhost."""
    if not addr.startswith("tcp://"):
        return True
    host = addr[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def is_loopback_host(host: str) -> bool:
    """An HTTP --host that only this machine reaches: 127.0.0.0/8, ::1 or localhost."""
    return is_loopback_address(f"tcp://{host}:0")


# Help text per field; the CLI below is generated from the struct.
_HELP: dict[str, str] = {
    "model_path": "a Hugging Face checkpoint: a local dir, or a Hub id ORG/NAME[@REVISION] downloaded once into "
    "--download-dir (a local dir of that name wins); 'demo' = the shipped demo (adapters: reverse, sort, mirror)",
    "served_model_name": "base model name in the OpenAI API (default: the Hub id, or the last path component)",
    "revision": "the Hub revision of the model: a branch, tag or commit; none = the default branch",
    "tokenizer": "the tokenizer's Hub id or dir; none = the model's",
    "tokenizer_revision": "the Hub revision of --tokenizer",
    "download_dir": "where Hub models are downloaded; none = the Hugging Face cache (HF_HUB_CACHE / HF_HOME), shared "
    "with other tools",
    "hf_token": "Hub token for gated or private models; none = HF_TOKEN, or the token `hf auth login` saved",
    "load_format": "where the weights come from: auto or safetensors (the checkpoint's *.safetensors files), dummy "
    "(random weights on the checkpoint's config.json, weight files or not: benchmarks and tests at real shapes)",
    "hf_overrides": "JSON object merged into the model's config.json before anything reads it, e.g. "
    "'{\"num_hidden_layers\": 2}' (nested objects merge key by key)",
    "host": "HTTP bind address",
    "port": "HTTP port",
    "tp": "tensor-parallel worker processes",
    "device": "cpu or cuda (default: cuda if available)",
    "dtype": "auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16 or float16",
    "quantization": "the checkpoint's quantization (vLLM's names): auto = as config.json's quantization_config says; "
    "a named method must match it; none = plain weights (docs/QUANTIZATION.md)",
    "enable_lora": "turn LoRA on (implied by --lora-paths)",
    "lora_backend": "LoRA kernels: triton (CUDA), cpu (compiled AVX-512 BF16 kernels; bfloat16 on the CPU, also used "
    "for attention and norms), torch (torch ops, any device); auto = triton on CUDA, else cpu where it builds and "
    "runs, else torch",
    "attention_backend": "attention kernels: triton (paged Triton kernels reading K/V from the cache pages in place; "
    "CUDA), cpu (decodes in the compiled CPU kernels, prefills in SDPA; needs --lora-backend cpu or auto to build "
    "them), torch (SDPA over gathered pages); auto = triton on CUDA, else cpu where the CPU kernels run and take the "
    "model's head shapes, else torch",
    "enable_cuda_graph": "capture decode steps as CUDA graphs at start-up, one per batch size of a ladder up to "
    "--cuda-graph-max-bs, and replay them (CUDA, --attention-backend triton; ignored on a CPU, with a log line)",
    "disable_cuda_graph": "SGLang's switch: decode runs eagerly (the default until a GPU run confirms the graphs)",
    "cuda_graph_max_bs": "largest decode batch replayed from a CUDA graph (default: --max-running-requests); larger "
    "batches run eagerly",
    "lora_paths": "adapters loaded at start: NAME=PATH, PATH, or JSON {lora_name, lora_path, pinned}",
    "max_loras_per_batch": "device adapter slots = most distinct adapters in one forward pass",
    "max_loaded_loras": "adapters kept in host memory (LRU beyond it); default unlimited",
    "lora_drain_timeout": "seconds an unload waits for the adapter's running requests",
    "max_lora_rank": "largest adapter rank the device pool holds",
    "lora_target_modules": "modules the device pool covers (names or 'all': the decoder layers' seven linears; "
    "embed_tokens and lm_head by name)",
    "lora_path_root": "when set, lora_path must resolve inside this directory",
    "api_key": "bearer key for every endpoint but /health",
    "admin_api_key": "bearer key for adapter load/unload",
    "rpc_addr": "ZeroMQ address of the internal RPC endpoint (tcp://host:port or ipc://path)",
    "max_running_requests": "most requests decoding at once",
    "max_running_per_adapter": "most requests of one adapter running at once (default unlimited)",
    "disable_adapter_fairness": "admit waiting requests first come, first served rather than by fair share between "
    "adapters (virtual token counters, per API key and adapter)",
    "scheduling_policy": "fcfs: waiting requests run by arrival (fair between adapters unless "
    "--disable-adapter-fairness); priority: by the request's `priority` (lower first), then as fcfs; a preemption "
    "then takes the lowest priority first",
    "max_requests_per_minute_per_key": "requests one API key may start per minute; past it 429 with Retry-After "
    "(needs --api-key)",
    "max_tokens_per_minute_per_key": "prompt + output tokens one API key may use per minute; past it 429 with "
    "Retry-After (needs --api-key)",
    "max_total_tokens": "KV cache capacity in tokens (default: sized from the context length)",
    "context_length": "longest prompt + output (default: the model's max_position_embeddings)",
    "max_prefill_tokens": "most prompt tokens prefilled in one forward pass",
    "page_size": "tokens per KV cache page",
    "seed": "random seed for sampling without a per-request seed",
    "log_level": "logging level",
    "nnodes": "nodes for multi-node tensor parallelism",
    "node_rank": "this node's rank",
    "dist_init_addr": "host:port of the torch.distributed rendezvous; with --nnodes > 1 the one address every node "
    "agrees on, hosted by node 0 (default: a free local port)",
    "lora_load_timeout": "seconds an adapter operation waits for every rank before it fails and is rolled back",
    "lora_state_file": "adapter registry file, rewritten after every change and restored at start",
    "lora_resolver_dir": "an unknown adapter X named by a request is loaded from DIR/X on first use (DIR may also "
    "be s3://bucket/prefix or hf://org)",
    "lora_cache_dir": "where Hub and S3 adapters are downloaded (default: ~/.cache/loraplex/adapters)",
    "lora_cache_max_gb": "size cap of --lora-cache-dir in GB; past it the least recently used adapters are deleted",
    "disable_lora_updates": "serve the start-up adapters only: every load/unload after start is refused (403)",
    "shutdown_timeout": "seconds in-flight requests may run after SIGTERM before they are aborted",
    "dist_timeout": "seconds before a collective times out once serving (a backstop)",
    "chunked_prefill_size": "most prompt tokens one forward pass takes, summed over requests; -1 = whole prompts "
    "(default: 2048 on CUDA, 512 on CPU)",
    "disable_radix_cache": "turn off the prefix cache (keyed by adapter)",
    "no_enable_prefix_caching": "vLLM's spelling of --disable-radix-cache",
    "dp_size": "data-parallel replicas behind one frontend, each a scheduler and --tp workers",
    "gpu_memory_utilization": "share of the GPU's memory this server may use, KV cache included (CUDA; "
    "default: the KV cache takes 0.85 of what is free after the weights)",
    "lora_modules": "vLLM's adapters loaded at start: NAME=PATH or JSON {name, path, base_model_name}",
    "reasoning_parser": "chat answers put the model's <think>...</think> text in reasoning_content: deepseek_r1 (the "
    "template opened <think>) or qwen3 (reasoning only where the output opens <think>); a structured-output "
    "constraint then applies after </think>",
    "chat_template": "chat template for /v1/chat/completions: a file, or inline Jinja (default: the tokenizer's)",
    "enable_auto_tool_choice": "tool_choice auto: the model's text is read for tool calls (needs --tool-call-parser)",
    "tool_call_parser": "the format of the model's tool calls (tool_choice auto); required and named choices are "
    "forced by a grammar and need none",
    "allow_unauthenticated_lora_updates": "allow run-time adapter loads and unloads on a non-loopback --host without "
    "--api-key or --admin-api-key (off by default: updates are refused with 403 updates_disabled)",
    "cluster_key_file": "CURVE key file (written by `loraplex keygen PATH`): encrypts and authenticates every TCP "
    "ZeroMQ socket between nodes and a TCP --rpc-addr; required with --nnodes > 1 or a non-loopback TCP --rpc-addr",
    "audit_log": "file that gets one JSON line per adapter operation or refusal (rotated at 100 MB)",
    "lora_allow_base_mismatch": "load an adapter whose base_model_name_or_path names another model (with a warning); "
    "without it only an adapter for another Hub model (family, version or size) is refused",
    "lora_strict_base_match": "refuse an adapter whose base_model_name_or_path does not name the served model, also "
    "where the names cannot tell (a local path, a re-uploader's spelling); without it those load with a warning",
    "lora_require_manifest": "an adapter needs loraplex-manifest.json (SHA-256 of every file read), checked before "
    "any rank reads it",
}

# `loraplex --help` shows the flags in these groups, in this order; every field belongs to exactly one.
_TOPICS: dict[str, str] = {
    "model and devices": "model_path served_model_name revision tokenizer tokenizer_revision download_dir hf_token "
    "load_format hf_overrides device dtype quantization tp dp_size "
    "context_length seed",
    "HTTP server and access": "host port api_key admin_api_key rpc_addr shutdown_timeout log_level "
    "max_requests_per_minute_per_key max_tokens_per_minute_per_key",
    "LoRA adapters": "enable_lora lora_paths lora_modules max_loras_per_batch max_loaded_loras max_lora_rank "
    "lora_target_modules lora_backend lora_path_root lora_resolver_dir lora_cache_dir lora_cache_max_gb "
    "lora_state_file disable_lora_updates lora_drain_timeout lora_load_timeout",
    "scheduling and KV cache": "max_running_requests max_total_tokens max_prefill_tokens chunked_prefill_size "
    "page_size disable_radix_cache no_enable_prefix_caching gpu_memory_utilization max_running_per_adapter "
    "disable_adapter_fairness scheduling_policy",
    "attention and CUDA graphs": "attention_backend enable_cuda_graph disable_cuda_graph cuda_graph_max_bs",
    "multi-node": "nnodes node_rank dist_init_addr dist_timeout",
    "chat and tools": "chat_template enable_auto_tool_choice tool_call_parser reasoning_parser",
    "security and audit": "allow_unauthenticated_lora_updates cluster_key_file audit_log lora_allow_base_mismatch "
    "lora_strict_base_match lora_require_manifest",
}
# A field missing from _TOPICS lands here (tests/process/test_help_and_progress.py catches it).
OTHER_TOPIC = "other options"


def field_topic(name: str) -> str:
    return next((topic for topic, names in _TOPICS.items() if name in names.split()), OTHER_TOPIC)


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
# vLLM's short forms
_SHORT: dict[str, str] = {"tensor_parallel_size": "-tp", "data_parallel_size": "-dp", "quantization": "-q"}
# Their names for our choices: field -> {their value: ours}.
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "dtype": {"half": "float16", "float": "float32"},  # vLLM and SGLang
    "lora_backend": {"csgmv": "triton", "torch_native": "torch"},  # SGLang's CUDA kernels and torch ops
    "attention_backend": {"torch_native": "torch"},  # SGLang
    "tool_call_parser": {"llama3": "llama3_json", "qwen25": "hermes", "qwen": "hermes"},  # SGLang
}
DEFAULT_LORA_RANK = 16  # --enable-lora with nothing to infer the pool from (vLLM's default; all seven modules)


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model_path: str = "demo"
    served_model_name: str | None = None
    revision: str | None = None
    tokenizer: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    hf_token: str | None = None
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    hf_overrides: dict[str, Any] = {}
    host: str = "127.0.0.1"
    port: int = 30000
    tp: int = 1
    device: Literal["cpu", "cuda"] | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["auto", "fp8", "compressed-tensors", "gptq", "awq", "none"] = "auto"
    enable_lora: bool = False
    lora_backend: Literal["auto", "triton", "cpu", "torch"] = "auto"
    attention_backend: Literal["auto", "triton", "cpu", "torch"] = "auto"
    enable_cuda_graph: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    lora_paths: list[str] = []
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    lora_drain_timeout: float = 120.0
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    lora_path_root: str | None = None
    api_key: str | None = None
    admin_api_key: str | None = None
    rpc_addr: str | None = None
    max_running_requests: int = 64
    max_total_tokens: int | None = None
    context_length: int | None = None
    max_prefill_tokens: int = 8192
    page_size: int = 16
    seed: int = 0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    lora_load_timeout: float = 60.0
    lora_state_file: str | None = None
    lora_resolver_dir: str | None = None
    lora_cache_dir: str | None = None
    lora_cache_max_gb: float = 20.0
    disable_lora_updates: bool = False
    shutdown_timeout: float = 20.0
    dist_timeout: float = 30.0
    chunked_prefill_size: int | None = None
    disable_radix_cache: bool = False
    no_enable_prefix_caching: bool = False
    dp_size: int = 1
    gpu_memory_utilization: float | None = None
    lora_modules: list[str] = []
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None
    chat_template: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "qwen3_coder", "xml", "pythonic"] | None = None
    max_running_per_adapter: int | None = None
    disable_adapter_fairness: bool = False
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    max_requests_per_minute_per_key: int | None = None
    max_tokens_per_minute_per_key: int | None = None
    allow_unauthenticated_lora_updates: bool = False
    cluster_key_file: str | None = None
    audit_log: str | None = None
    lora_allow_base_mismatch: bool = False
    lora_strict_base_match: bool = False
    lora_require_manifest: bool = False

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
                     "max_running_per_adapter", "max_requests_per_minute_per_key", "max_tokens_per_minute_per_key"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        for name in ("lora_drain_timeout", "lora_load_timeout", "dist_timeout", "lora_cache_max_gb"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            raise ConfigError(f"--chunked-prefill-size must be >= 1 or -1 (off), got {self.chunked_prefill_size}")
        if self.dp_size > 1 and self.nnodes > 1:
            raise ConfigError("--dp-size > 1 with --nnodes > 1 is not supported: replicas run on one node")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
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
                raise ConfigError(f"--{_flag(name)} limits each API key: it needs --api-key")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} outside 0..{self.nnodes - 1}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("--nnodes > 1 needs --dist-init-addr HOST:PORT (the one address every node agrees on)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--dist-init-addr {self.dist_init_addr!r} is not HOST:PORT")
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
    def lora_updates_need_key(self) -> bool:
        """Safe default: beyond loopback, run-time adapter updates need a key, or an explicit opt-out."""
        return not (is_loopback_host(self.host) or self.api_key or self.admin_api_key
                    or self.allow_unauthenticated_lora_updates)

    @property
    def prefix_caching(self) -> bool:
        return not (self.disable_radix_cache or self.no_enable_prefix_caching)

    def chunked_prefill_tokens(self, device_type: str) -> int:
        """The step's prefill token budget (-1 = off), defaulting by device."""
        if self.chunked_prefill_size is not None:
            return self.chunked_prefill_size
        return 2048 if device_type == "cuda" else 512

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_paths) or bool(self.lora_modules)

    @property
    def lora_sources(self) -> list[LoRASource]:
        """The start-up adapters: --lora-paths, then --lora-modules."""
        return [parse_lora_source(t) for t in self.lora_paths] + [parse_lora_module(t) for t in self.lora_modules]

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
                raise ConfigError(f"--{_flag(alias)} and --{_flag(name)} are the same setting: give only one")
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


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _field_type(field: msgspec.structs.FieldInfo) -> tuple[str, Any]:
    """Classify a field for argparse: (kind, element type)."""
    info = msgspec.inspect.type_info(field.type)
    if isinstance(info, msgspec.inspect.UnionType):
        info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
    if isinstance(info, msgspec.inspect.BoolType):
        return "bool", None
    if isinstance(info, msgspec.inspect.ListType):
        return "list", str
    if isinstance(info, msgspec.inspect.DictType):
        return "scalar", json_object
    if isinstance(info, msgspec.inspect.LiteralType):
        return "choice", list(info.values)
    return "scalar", {msgspec.inspect.IntType: int, msgspec.inspect.FloatType: float}.get(type(info), str)


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object value; argparse names the flag when this raises."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text}")
    return value


FOREIGN_TOPIC = "vLLM and SGLang flags with no setting here, accepted with a log line or refused"


class _OneLineParser(argparse.ArgumentParser):
    """A usage error is one line naming the flag (the full usage is a screen long: --help shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_arg_parser(prog: str = "loraplex", *, model_positional: bool = False) -> argparse.ArgumentParser:
    """One flag per field, plus vLLM's and SGLang's spellings of some (ALIASES) and their flags we have no setting for
    (protocol/foreign_flags.py). A flag not given is absent from the parsed namespace (SUPPRESS), so the struct's
    defaults apply and a setting given in both spellings can be told apart. No abbreviations: `--model` is a flag of
    its own, and a prefix of a flag is an error, as in vLLM. With model_positional (`loraplex serve MODEL`), MODEL
    is the first positional argument."""
    parser = _OneLineParser(
        prog=prog,
        description="loraplex: many LoRA adapters on one base model",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    if model_positional:
        parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="the same as --model-path MODEL")
    groups = {topic: parser.add_argument_group(topic) for topic in (*_TOPICS, OTHER_TOPIC)}
    fields = {field.name: field for field in msgspec.structs.fields(ServerConfig)}
    # Topic by topic, in the order _TOPICS lists them, each other spelling right after ours.
    ordered = [name for names in _TOPICS.values() for name in names.split() if name in fields]
    ordered += [name for name in fields if name not in ordered]
    entries = [(dest, name) for name in ordered for dest in (name, *sorted(a for a, n in ALIASES.items() if n == name))]
    for dest, name in entries:
        field = fields[name]
        group = groups[field_topic(name)]
        kind, elem = _field_type(field)
        help_text = _HELP.get(name, "") if dest == name else f"the same as --{_flag(name)} (vLLM's or SGLang's name)"
        option_strings = ["--" + _flag(dest), *([_SHORT[dest]] if dest in _SHORT else [])]
        default = field.default
        if kind == "bool":
            group.add_argument(*option_strings, dest=dest, action="store_true", help=help_text)
        elif kind == "list":
            group.add_argument(*option_strings, dest=dest, nargs="+", help=help_text)
        elif kind == "choice":
            choices = [*elem, *VALUE_ALIASES.get(name, {})]
            group.add_argument(*option_strings, dest=dest, choices=choices, help=f"{help_text} (default: {default})")
        else:
            group.add_argument(*option_strings, dest=dest, type=elem, help=f"{help_text} (default: {default})")
    foreign = parser.add_argument_group(FOREIGN_TOPIC)
    for flag in FOREIGN_FLAGS:
        help_text = f"({flag.family}) {flag.summary}"
        if flag.takes_value:
            foreign.add_argument(*flag.names, dest=flag.dest, metavar="VALUE", help=help_text)
        else:
            foreign.add_argument(*flag.names, dest=flag.dest, action="store_true", help=help_text)
    return parser


def parse_command_line(argv: list[str] | None = None) -> tuple[ServerConfig, list[str]]:
    """`loraplex [flags]` or `loraplex serve MODEL [flags]` (vLLM's form) -> the config, and one note per accepted
    flag of vLLM's or SGLang's that changes nothing here (for the start-up log). A refused flag is a ConfigError
    naming it and why."""
    argv = sys.argv[1:] if argv is None else list(argv)
    is_serve = bool(argv) and argv[0] == "serve"
    parser = build_arg_parser("loraplex serve" if is_serve else "loraplex", model_positional=is_serve)
    kwargs = vars(parser.parse_args(argv[1:] if is_serve else argv))
    if "model_tag" in kwargs:
        model = kwargs.pop("model_tag")
        given = [f"--{_flag(k)}" for k in ("model_path", "model") if k in kwargs]
        if given:
            raise ConfigError(f"the model is given twice: as MODEL ({model}) and as {given[0]}; give it once")
        kwargs["model_path"] = model
    notes = []
    for dest in [k for k in kwargs if k in FOREIGN_BY_DEST]:
        flag, value = FOREIGN_BY_DEST[dest], kwargs.pop(dest)
        try:
            notes.append(flag.check(value if flag.takes_value else None))
        except ValueError as e:
            raise ConfigError(str(e)) from e
        for name, setting in (flag.sets or {}).items():
            if name in kwargs:
                raise ConfigError(f"{flag.names[0]} and --{_flag(name)} are the same setting: give only one")
            kwargs[name] = setting
    return ServerConfig.from_kwargs(**kwargs), notes


def config_from_args(argv: list[str] | None = None) -> ServerConfig:
    return parse_command_line(argv)[0]
