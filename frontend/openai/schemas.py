"""The request bodies of the OpenAI-side APIs (completions, chat, Responses; vLLM's adapter and tokenizer routes):
strict schemas (ranges included), the unimplemented parameters accepted at their neutral values, and chat messages
as a template takes them. The native API's bodies are in frontend/params.py."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from loraplex.frontend.chat_template import ChatOptions
from loraplex.frontend.constraints import ResponseFormat, StructuredOutputs
from loraplex.frontend.params import (
    MAX_INT64,
    MAX_N,
    AdapterPath,
    Int64,
    LogitBias,
    LoRAMixBody,
    LoRAScale,
    MinP,
    Penalty,
    RepetitionPenalty,
    Seed,
    Strict,
    Temperature,
    TokenCount,
    TokenId,
    TopK,
    TopLogprobs,
    TopP,
    decode_body,
    strip_neutral,
)
from loraplex.frontend.tools.request import Tool, ToolChoice, template_tools

# OpenAI parameters we do not implement, with the neutral values that mean "off" and are therefore accepted.
NEUTRAL = {
    "top_logprobs": (None, 0),  # completions (chat has it as a field)
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "audio": (None,),
}


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CommonParams(Strict, kw_only=True):
    model: str
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Seed | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1
    user: str | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_p: MinP = 0.0
    min_tokens: TokenCount = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0  # vLLM's: --scheduling-policy priority runs lower first; fcfs ignores it
    lora_scale: LoRAScale | None = None  # the strength of the adapter `model` names, or of lora_mix (None: 1)
    # a weighted mix of loaded adapters, served for `model` the base (frontend/adapters/mixes.py checks it)
    lora_mix: LoRAMixBody | None = None
    # vLLM's logit controls (frontend/params.py logit_controls)
    logit_bias: LogitBias | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    return_token_ids: bool | None = None  # vLLM's: the prompt's and each choice's token ids in the answer
    prompt_logprobs: TopLogprobs | None = None  # vLLM's: each prompt token's logprob and this many alternatives
    # structured output (frontend/constraints.py), at most one of these (and of structured_outputs' fields):
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(CommonParams, kw_only=True):
    prompt: str | list[str | TokenId | list[TokenId]]  # text, texts, token ids, or lists of token ids
    logprobs: TopLogprobs | None = None  # each output token's logprob and this many alternatives
    echo: bool = False  # the prompt's text before the completion (and its tokens' logprobs, with logprobs)


class TextPart(Strict, tag="text", tag_field="type", kw_only=True):
    text: str


class ImageURL(Strict, kw_only=True):
    url: str  # data:image/...;base64,..., http(s)://... or file://... (frontend/multimodal/sources.py)
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; the model's image processor sets the size


class ImageURLPart(Strict, tag="image_url", tag_field="type", kw_only=True):
    """An image in a message (a vision-language model's; any other model refuses it with a 400)."""

    image_url: ImageURL


class ToolCallFunction(Strict, kw_only=True):
    name: str
    arguments: str | dict[str, Any]  # JSON text, as OpenAI sends it (an object, as templates take it, passes too)


class ToolCall(Strict, kw_only=True):
    """An assistant's earlier call, as OpenAI's clients send it back."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Strict, kw_only=True):
    """A message as OpenAI's clients send it; a field not here is refused (400 naming it), never dropped."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart | ImageURLPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None


class ChatRequest(CommonParams, kw_only=True):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None  # needs logprobs: true
    # frontend/chat_template.py (vLLM's fields)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # frontend/tools/: passed to the template; tool_choice says how the output becomes calls
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None


def strip_openai(schema: type[CommonParams]) -> Any:
    """The unimplemented parameters set to their neutral values are dropped; others are refused."""
    return lambda raw: strip_neutral(raw, set(schema.__struct_fields__), NEUTRAL, "parameter")


def decode_openai(body: bytes, schema: type[CommonParams]) -> Any:
    return decode_body(body, schema, strip_openai(schema))


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as a chat template takes them: text parts joined into one text (a message with images keeps its
    parts, each image as {"type": "image"}, where a vision model's template puts its placeholder); name, tool_calls,
    tool_call_id and reasoning_content passed on where set (Hugging Face templates read them)."""
    rendered = []
    for m in messages:
        content: Any = m.content
        if isinstance(m.content, list) and any(isinstance(part, ImageURLPart) for part in m.content):
            content = [{"type": "image"} if isinstance(part, ImageURLPart) else {"type": "text", "text": part.text}
                       for part in m.content]  # fmt: skip
        elif isinstance(m.content, list):
            content = "".join(part.text for part in m.content)
        message: dict[str, Any] = {"role": m.role, "content": content or ""}
        for field in ("name", "tool_call_id", "reasoning_content"):
            if getattr(m, field) is not None:
                message[field] = getattr(m, field)
        if m.tool_calls is not None:
            message["tool_calls"] = [template_tool_call(msgspec.to_builtins(call)) for call in m.tool_calls]
        rendered.append(message)
    return rendered


def chat_images(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """The messages' images in prompt order: (the part's JSON path, for errors; its URL)."""
    return [(f"messages[{i}].content[{j}]", part.image_url.url)
            for i, m in enumerate(messages) if isinstance(m.content, list)
            for j, part in enumerate(m.content) if isinstance(part, ImageURLPart)]  # fmt: skip


def chat_options(req: Any) -> ChatOptions:
    """From a ChatRequest or a /tokenize body with messages (the same fields)."""
    return ChatOptions(add_generation_prompt=req.add_generation_prompt,
                       continue_final_message=req.continue_final_message, tools=template_tools(req.tools),
                       template_kwargs=req.chat_template_kwargs or {})


def template_tool_call(call: dict) -> dict:
    """A tool call as templates take it: its function's `arguments` as an object, where OpenAI sends JSON text
    (as vLLM turns them; a text that is not JSON stays text)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


# ---- POST /v1/responses -------------------------------------------------------------------------------

# Responses parameters we do not implement, with the neutral values that mean "off" and are therefore accepted.
# store: responses are never kept, so only false (or absent, which vLLM too serves unstored) is accepted.
RESPONSES_NEUTRAL = {
    "store": (None, False),
    "previous_response_id": (None,),
    "include": (None, []),
    "metadata": (None, {}),
    "reasoning": (None,),
    "text": (None, {"format": {"type": "text"}}),
    "truncation": (None, "disabled"),
    "service_tier": (None, "auto", "default"),
    "background": (None, False),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
}


class InputText(Strict, tag="input_text", tag_field="type"):
    text: str


class OutputTextPart(Strict, tag="output_text", tag_field="type", kw_only=True):
    """An earlier answer's text, as a client sends its previous output back."""

    text: str
    annotations: list[Any] = []
    logprobs: list[Any] | None = None


class MessageItem(Strict, kw_only=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText | OutputTextPart]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None


class FunctionCallItem(Strict, kw_only=True):
    """An earlier function call of the assistant (a client's previous output, sent back with its result)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict, kw_only=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


INPUT_ITEMS: dict[str, type] = {"message": MessageItem, "function_call": FunctionCallItem,
                                "function_call_output": FunctionCallOutputItem}
InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(Strict, kw_only=True):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None: any object
    strict: bool | None = None  # a forced call's arguments always follow the schema


class ToolChoiceFunction(Strict, kw_only=True):
    type: Literal["function"]
    name: str


ResponsesToolChoice = Literal["none", "auto", "required"] | ToolChoiceFunction


class ResponsesRequest(Strict, kw_only=True):
    model: str
    # a text, or items: messages ({"role", "content"}, type "message" optional), function_call, function_call_output;
    # each item is checked against its type's schema (openai/responses.py input_items)
    input: str | list[dict]
    instructions: str | None = None  # a system message before the input
    tools: list[FunctionTool] = []
    tool_choice: ResponsesToolChoice = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT64)] | None = None  # None: the context's rest
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stream: bool = False
    user: str | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension: the output's shape, as on chat


def strip_responses(raw: dict) -> dict:
    """The unimplemented parameters set to their neutral values are dropped; others are refused (400 naming them)."""
    return strip_neutral(raw, set(ResponsesRequest.__struct_fields__), RESPONSES_NEUTRAL, "parameter")


# ---- vLLM's adapter and tokenizer routes ----------------------------------------------------------------


class VllmLoadBody(Strict):
    lora_name: str
    lora_path: AdapterPath
    load_inplace: bool = False
    pinned: bool | None = None  # None: a new adapter is unpinned, an in-place reload keeps its own
    draft_lora_path: AdapterPath | None = None  # its draft model's adapter (speculative decoding)


class VllmUnloadBody(Strict):
    lora_name: str
    lora_int_id: Int64 | None = None  # accepted for vLLM clients, unused


class TokenizeBody(Strict):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    model: str | None = None
    # with messages, as on /v1/chat/completions (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None


class DetokenizeBody(Strict):
    tokens: list[TokenId]
    model: str | None = None
