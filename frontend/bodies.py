"""Response bodies of the HTTP routes as Structs: /openapi.json's response schemas come from these.

Routes build the small ones directly; the /generate item and the adapter rows are built as dicts (the Engine and
the RPC return them too) and match these shapes, which tests/integrations/test_openapi.py checks against a live server.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from loraplex.frontend.adapters.audit import AuditEntry


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    code: int


class ErrorResponse(msgspec.Struct):
    """Every failure, on every route and in every stream: error_body builds it."""

    error: ErrorDetail


ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 409: "ConflictError", 413: "RequestTooLarge", 429: "rate_limited",
               499: "ClientClosedRequest",
               500: "InternalServerError", 501: "NotImplementedError", 503: "ServiceUnavailableError",
               504: "TimeoutError"}


def error_body(message: str, status: int) -> ErrorResponse:
    return ErrorResponse(ErrorDetail(message=message, type=ERROR_TYPES.get(status, "Error"), code=status))


# ---- native ----------------------------------------------------------------------------------------


class StopFinish(msgspec.Struct, tag_field="type", tag="stop"):
    matched: str | int | None  # the stop string, or the stop token id


class LengthFinish(msgspec.Struct, tag_field="type", tag="length"):
    length: int


class AbortFinish(msgspec.Struct, tag_field="type", tag="abort"):
    message: str


LogprobEntry = tuple[float, int, str | None]  # [logprob, token_id, text or null]


class MetaInfo(msgspec.Struct, omit_defaults=True):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache (SGLang's name)
    finish_reason: StopFinish | LengthFinish | AbortFinish | None
    # with return_logprob: one entry per output token (a stream chunk: its own tokens')
    output_token_logprobs: list[LogprobEntry] | None = None
    # with return_logprob and top_logprobs_num > 0: per output token, the top_logprobs_num best, best first
    output_top_logprobs: list[list[LogprobEntry]] | None = None


class GenerateResponse(msgspec.Struct):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo


class GenerateChunk(msgspec.Struct, omit_defaults=True):
    """One streamed /generate event: the item's state so far; `index` is its place in a batch."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | None = None


class AbortResponse(msgspec.Struct):
    success: bool  # False: no request with that rid was in flight
    rid: str
    message: str


class HealthResponse(msgspec.Struct, omit_defaults=True):
    status: Literal["ok", "unhealthy"]
    reason: str | None = None


class ModelInfoResponse(msgspec.Struct):
    model_path: str
    served_model_name: str
    is_generation: bool


class TokenizeResponse(msgspec.Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct):
    version: str


class TokenizerInfoResponse(msgspec.Struct):
    """vLLM's /tokenizer_info. Besides these, the tokenizer's own settings as tokenizer_config.json gave them (no
    file names; an added token as its text)."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    model_max_length: int  # the tokenizer's own (transformers' 10**30 when the model sets none), as vLLM gives it
    chat_template: str | dict[str, str] | None  # the one chat requests go through: --chat-template or the tokenizer's


class ServerInfoResponse(msgspec.Struct):
    """Besides these, every server config field (keys masked)."""

    model_dir: str | None
    revision: str | None  # the commit served (Hub id or HF-cache snapshot), in place of the --revision asked for
    served_model_name: str
    quantization: str | None  # the checkpoint's method in use (config field --quantization says what was asked)
    max_total_tokens: int | None
    context_length: int | None
    vocab_size: int | None
    lora_enabled: bool
    max_lora_rank: int | None
    lora_target_modules: list[str] | None
    process_ids: dict[str, int]
    healthy: bool
    num_requests_in_flight: int
    num_adapter_entries: int
    num_adapter_holds: int
    slot_lora_ids: list[int] | None
    num_running: int | None
    num_waiting: int | None
    kv_usage: float | None
    replicas: list[ReplicaInfo]  # one per data-parallel replica (--dp-size), by dp_rank


class ReplicaInfo(msgspec.Struct):
    dp_rank: int
    max_total_tokens: int
    num_requests_in_flight: int  # routed to it and not finished
    num_requests_routed: int  # since start
    num_running: int | None
    num_waiting: int | None
    kv_usage: float | None
    slot_lora_ids: list[int] | None
    num_loaded_adapters: int | None


class AdapterResult(msgspec.Struct):
    lora_name: str
    success: bool
    error_message: str


class AdapterReply(msgspec.Struct, omit_defaults=True):
    """Load and unload, single form; the batch form adds `results`."""

    success: bool
    error_message: str
    loaded_adapters: dict[str, str | None]  # name -> path; null: loaded from tensors
    results: list[AdapterResult] | None = None


class AdapterRow(msgspec.Struct):
    lora_name: str
    lora_path: str | None  # null: loaded from tensors
    lora_id: int
    rank: int
    target_modules: list[str]
    pinned: bool
    resident_slot: int | None  # the slot on the lowest dp_rank that holds it
    resident_slots: dict[str, int | None]  # dp_rank -> slot (empty where the slots were not asked)
    requests_in_flight: int
    draining: bool
    in_host_memory: bool


class AdapterTable(msgspec.Struct):
    adapters: list[AdapterRow]
    task: str = "generate"  # what the server's adapters serve: generate, or the pooling runner's embed/rerank/classify


class AuditLogResponse(msgspec.Struct):
    """GET /audit_log: the last adapter operations and refusals, oldest first (--audit-log has every line)."""

    entries: list[AuditEntry]


# ---- OpenAI ----------------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "tool_calls", "abort"] | None


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens served from the prefix cache, whole pages


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # always an object, as OpenAI sends it ({"cached_tokens": 0} when nothing was cached); vLLM sends it only under
    # --enable-prompt-tokens-details and a hit, else null, so clients read it guarded for null
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None  # None for the first prompt token (echo)
    text_offset: list[int]


class PromptLogprob(msgspec.Struct):
    """vLLM's Logprob: one token's entry in a prompt position's prompt_logprobs."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, null for the first, else {token id: entry} holding the prompt token
# first, then the best, best first
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct, omit_defaults=True):  # the defaults below are vLLM's, left out unless asked
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    prompt_token_ids: list[int] | None = None  # return_token_ids (in a stream: a choice's first chunk)
    token_ids: list[int] | None = None  # return_token_ids: the output's (in a stream: the chunk's)
    prompt_logprobs: PromptLogprobs | None = None  # prompt_logprobs, or echo with logprobs (not streamed)


class CompletionResponse(msgspec.Struct):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCallItem(msgspec.Struct):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str | None  # null: only reasoning, or only tool calls
    # --reasoning-parser: the <think> text, null when there was none (clients read the field); absent without a parser
    reasoning_content: str | None | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[ToolCallItem] = []  # with tool calls alone, content is null


class ChatTopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprob] | None


class ChatChoice(msgspec.Struct, omit_defaults=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(msgspec.Struct):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # return_token_ids
    prompt_logprobs: PromptLogprobs | None = None  # prompt_logprobs: the prompt's, once for every choice (vLLM's)


class CompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]  # empty in the last chunk, which carries usage (stream_options.include_usage)
    usage: Usage | None = None


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None  # in a call's first delta
    arguments: str | None = None  # a piece


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None  # in a call's first delta, with type and function.name
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(msgspec.Struct, omit_defaults=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    token_ids: list[int] | None = None  # return_token_ids: the chunk's


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk


class ModelCard(msgspec.Struct, omit_defaults=True):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None
    parent: str | None
    max_model_len: int | None = None  # the base model's card only


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[ModelCard]
