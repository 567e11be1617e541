"""Every struct that crosses a process boundary. One tagged union per socket direction (bottom of file)."""

from __future__ import annotations

from typing import Union

import msgspec

from protocol.config import ServerConfig


class Struct(msgspec.Struct, tag=True, kw_only=True):
    pass


# ---- shared pieces -----------------------------------------------------------------------------


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: list[int] = []


class LoRAAdapterSpec(msgspec.Struct, frozen=True, kw_only=True):
    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: int = -1  # minted by the frontend's registry; -1 on the public RPC (the registry fills it)


class LoRAAdapterResult(msgspec.Struct, frozen=True, kw_only=True):
    lora_name: str
    success: bool
    error_message: str = ""
    # why it failed, for status codes: duplicate, not_found, forbidden, invalid, pinned_limit, busy, internal
    error_kind: str = ""
    lora_id: int = -1
    rank: int = 0
    target_modules: list[str] = []


# ---- public requests (HTTP, Engine and RPC all carry these) ------------------------------------


class GenerateReqInput(Struct, frozen=True):
    """The /generate body, single or batched, as the RPC carries it."""

    text: str | list[str] | None = None
    input_ids: list[int | list[int]] | None = None  # one prompt, or a batch of prompts
    sampling_params: dict | None = None
    lora_path: str | list[str | None] | None = None
    rid: str | list[str] | None = None
    stream: bool = False  # RPC: GenerateReqOutput chunks with finished=False, then one with finished=True


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


class LoadLoRAAdapterReqOutput(Struct, frozen=True):
    success: bool
    error_message: str = ""
    results: list[LoRAAdapterResult] = []
    loaded_adapters: dict[str, str] = {}


class UnloadLoRAAdapterReqInput(Struct, frozen=True):
    lora_names: list[str]
    lora_ids: list[int] = []  # filled by the registry before it reaches the scheduler


class UnloadLoRAAdapterReqOutput(Struct, frozen=True):
    success: bool
    error_message: str = ""
    results: list[LoRAAdapterResult] = []
    loaded_adapters: dict[str, str] = {}


class ListLoRAAdaptersReqInput(Struct, frozen=True):
    pass


class ListLoRAAdaptersReqOutput(Struct, frozen=True):
    adapters: list[dict] = []


class RpcError(Struct, frozen=True):
    error_message: str


# ---- frontend <-> scheduler --------------------------------------------------------------------


class TokenizedGenerateReq(Struct, frozen=True):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    lora_id: int | None = None  # None = base model


class AbortReq(Struct, frozen=True):
    rid: str


class SchedulerStatsReq(Struct, frozen=True):
    pass


class TokenDelta(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    rid: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (eos / stop token), "length", "abort", "error"
    error_message: str = ""


class TokenDeltas(Struct, frozen=True):
    deltas: list[TokenDelta]


class SchedulerStats(Struct, frozen=True):
    num_running: int
    num_waiting: int
    kv_usage: float  # 0..1
    running_lora_ids: list[int] = []
    waiting_lora_ids: list[int] = []
    slot_lora_ids: list[int] = []  # per device slot, -1 = empty


class SchedulerReady(Struct, frozen=True):
    max_total_tokens: int
    context_length: int
    vocab_size: int
    max_lora_rank: int = 0
    lora_target_modules: list[str] = []


class ProcessFailed(Struct, frozen=True):
    who: str
    error_message: str


# ---- scheduler <-> workers ---------------------------------------------------------------------


class ForwardReq(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    input_ids: list[int]  # tokens new to the KV cache this step
    num_cached_tokens: int  # tokens of this request already in the KV cache
    page_ids: list[int]  # the request's page table, covering num_cached_tokens + len(input_ids)
    sampling: SamplingParams
    num_generated: int = 0  # output tokens so far: with the seed, it makes sampling reproducible and stateless
    slot: int = -1  # adapter device slot, -1 = base model


class SlotLoad(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    slot: int
    lora_id: int  # -1 clears the slot


class ForwardBatch(Struct, frozen=True):
    batch_id: int
    reqs: list[ForwardReq]
    slot_loads: list[SlotLoad] = []  # applied before the forward pass


class BatchResult(Struct, frozen=True):
    batch_id: int
    next_token_ids: list[int]
    error_message: str = ""


class WorkerAdapterReport(Struct, frozen=True):
    rank: int
    results: list[LoRAAdapterResult]


class DropAdapters(Struct, frozen=True):
    """Tells ranks to forget adapters (unload, or a load that failed on another rank)."""

    lora_ids: list[int]


class WorkerReady(Struct, frozen=True):
    rank: int
    max_total_tokens: int
    context_length: int
    vocab_size: int
    max_lora_rank: int = 0
    lora_target_modules: list[str] = []


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
    # Empty: loads travel with the batches (the worker forwards them to its loader).
    scheduler_to_loaders: list[str] = []


class ProcessArgs(msgspec.Struct, frozen=True, kw_only=True):
    config: ServerConfig
    endpoints: Endpoints
    model_dir: str  # resolved checkpoint directory
    rank: int = 0  # the worker's local rank on its node; unused by the scheduler
    fault_hooks: dict[str, str] = {}  # test-only fault injection, e.g. {"fail_load_on_rank": "1"}


# ---- one union per socket direction ---------------------------------------------------------------

FrontendToScheduler = Union[
    TokenizedGenerateReq, AbortReq, LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput, SchedulerStatsReq, Shutdown
]
SchedulerToFrontend = Union[
    TokenDeltas, SchedulerReady, SchedulerStats, LoadLoRAAdapterReqOutput, UnloadLoRAAdapterReqOutput, ProcessFailed
]
SchedulerToWorker = Union[ForwardBatch, LoadLoRAAdapterReqInput, DropAdapters, Shutdown]
WorkerToScheduler = Union[BatchResult, WorkerAdapterReport, WorkerReady, ProcessFailed]
RpcRequest = Union[
    GenerateReqInput, AbortReqInput, LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput, ListLoRAAdaptersReqInput
]
RpcReply = Union[
    GenerateReqOutput,
    AbortReqOutput,
    LoadLoRAAdapterReqOutput,
    UnloadLoRAAdapterReqOutput,
    ListLoRAAdaptersReqOutput,
    RpcError,
]
