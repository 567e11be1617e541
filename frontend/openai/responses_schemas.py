"""OpenAI's Responses API (POST /v1/responses) as vLLM serves it: the Response object and the streamed events, each in
the shape the `openai` client's types parse (the request body is in schemas.py)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from loraplex.frontend.openai.schemas import FunctionTool, ResponsesToolChoice

# ---- the Response object --------------------------------------------------------------------------------


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any]


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(msgspec.Struct, tag="message", tag_field="type"):
    id: str
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]


class FunctionCall(msgspec.Struct, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus


OutputItem = OutputMessage | FunctionCall


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: Literal["max_output_tokens"]


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    output: list[OutputItem]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None
    error: None = None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[FunctionTool]
    tool_choice: ResponsesToolChoice
    parallel_tool_calls: bool
    metadata: dict = {}
    previous_response_id: None = None
    reasoning: None = None
    truncation: Literal["disabled"] = "disabled"
    user: str | None = None


# ---- streamed events (`event: <type>` and `data: <event>`, no closing [DONE]) ----------------------------


class ResponseEvent(msgspec.Struct, tag_field="type", kw_only=True):
    sequence_number: int


class ResponseCreated(ResponseEvent, tag="response.created", kw_only=True):
    response: ResponseObject


class ResponseInProgress(ResponseEvent, tag="response.in_progress", kw_only=True):
    response: ResponseObject


class ResponseCompleted(ResponseEvent, tag="response.completed", kw_only=True):
    """The last event of a response that ended by itself."""

    response: ResponseObject


class ResponseIncomplete(ResponseEvent, tag="response.incomplete", kw_only=True):
    """The last event of a response cut by max_output_tokens (status "incomplete", with incomplete_details), as OpenAI
    sends it; clients tell the two apart (vLLM sends response.completed for both)."""

    response: ResponseObject


class OutputItemAdded(ResponseEvent, tag="response.output_item.added", kw_only=True):
    output_index: int
    item: OutputItem


class OutputItemDone(ResponseEvent, tag="response.output_item.done", kw_only=True):
    output_index: int
    item: OutputItem


class ContentPartAdded(ResponseEvent, tag="response.content_part.added", kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartDone(ResponseEvent, tag="response.content_part.done", kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(ResponseEvent, tag="response.output_text.delta", kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class OutputTextDone(ResponseEvent, tag="response.output_text.done", kw_only=True):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class ArgumentsDelta(ResponseEvent, tag="response.function_call_arguments.delta", kw_only=True):
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(ResponseEvent, tag="response.function_call_arguments.done", kw_only=True):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(ResponseEvent, tag="error", kw_only=True):
    """A failure after the stream began (a process died, a grammar broke); the stream ends with it."""

    code: str
    message: str
    param: str | None = None


STREAM_EVENTS = (ResponseCreated, ResponseInProgress, OutputItemAdded, ContentPartAdded, OutputTextDelta,
                 OutputTextDone, ContentPartDone, ArgumentsDelta, ArgumentsDone, OutputItemDone, ResponseCompleted,
                 ResponseIncomplete, ErrorEvent)
