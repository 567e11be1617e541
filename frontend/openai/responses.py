"""One /v1/responses request without HTTP: its input items as chat messages through the chat template (tools
included), a forced function call as a JSON-schema constraint, and the answer as a Response object or its events.

The generation itself is the chat route's (serving.start_openai): the same model resolution, sampling and
admission, so a Responses request and a chat request with the same messages produce the same tokens."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from loraplex.frontend.chat_template import ChatOptions
from loraplex.frontend.constraints import Found
from loraplex.frontend.errors import InputError
from loraplex.frontend.generate import GenerateService, GenerationFailed, raise_failure
from loraplex.frontend.openai.responses_events import EventWriter, ParsedItemsStream, new_id, parsed_items
from loraplex.frontend.openai.responses_schemas import (
    ErrorEvent,
    FunctionCall,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseCompleted,
    ResponseCreated,
    ResponseEvent,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseObject,
    ResponseUsage,
)
from loraplex.frontend.openai.schemas import (
    INPUT_ITEMS,
    ChatMessage,
    ChatRequest,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    MessageItem,
    ResponsesRequest,
    ToolCall,
    ToolCallFunction,
    chat_messages,
)
from loraplex.frontend.openai.serving import OpenAIRun, start_openai
from loraplex.frontend.params import convert
from loraplex.frontend.tools.parsers import PARSERS
from loraplex.frontend.tools.request import ToolPlan
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import OutputConstraint

ANY_OBJECT: dict = {"type": "object"}  # a tool without `parameters` takes any object


def input_items(raw: str | list[dict]) -> list[InputItem]:
    """The request's input as typed items: a text is one user message; each listed item is checked against the
    schema of its `type` (a message may leave `type` out)."""
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    if not raw:
        raise InputError("'input' is empty")
    items = []
    for i, item in enumerate(raw):
        kind = item.get("type", "message")
        schema = INPUT_ITEMS.get(kind) if isinstance(kind, str) else None
        if schema is None:
            raise InputError(f"input[{i}] has type {kind!r}; supported: {', '.join(INPUT_ITEMS)}")
        items.append(convert(item, schema, f"input[{i}]", path=f"input[{i}]"))
    return items


def chat_of(items: list[InputItem], instructions: str | None) -> list[dict[str, Any]]:
    """The items as chat messages (the chat route's rendering): function calls join the assistant turn before them,
    a function call's output is a tool message."""
    messages: list[ChatMessage] = [ChatMessage(role="system", content=instructions)] if instructions else []
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=ToolCallFunction(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is None or last.role != "assistant":
                last = ChatMessage(role="assistant", content=None, tool_calls=[])
                messages.append(last)
            last.tool_calls = (last.tool_calls or []) + [call]
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        else:
            content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append(ChatMessage(role=item.role, content=content))
    return chat_messages(messages)


def template_tools(tools: list[FunctionTool]) -> list[dict] | None:
    """Function tools in the chat-completions shape chat templates read."""
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.parameters or ANY_OBJECT}} for t in tools]


def forced_call(req: ResponsesRequest) -> tuple[Found | None, FunctionTool | None]:
    """tool_choice as a constraint: a named function's arguments follow its parameters; `required` gives a JSON
    list of {"name", "arguments"} calls (one at most without parallel_tool_calls). Also the named tool, if any."""
    choice = req.tool_choice
    if choice in ("none", "auto"):
        return None, None
    if not req.tools:
        raise InputError(f"tool_choice {brief_choice(choice)} needs tools")
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters or ANY_OBJECT},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in req.tools]
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        return Found(OutputConstraint("json_schema", json.dumps(schema)), "tools"), None
    index = next((i for i, t in enumerate(req.tools) if t.name == choice.name), None)
    if index is None:
        raise InputError(f"tool_choice names function {choice.name!r}, which is not in tools")
    tool = req.tools[index]
    source = json.dumps(tool.parameters or ANY_OBJECT)
    return Found(OutputConstraint("json_schema", source), f"tools[{index}].parameters"), tool


def auto_plan(req: ResponsesRequest, config: ServerConfig) -> ToolPlan | None:
    """tool_choice auto with tools under --enable-auto-tool-choice: the --tool-call-parser reads the output's calls
    (the chat route's parser); without a parser the output stays text."""
    if req.tool_choice != "auto" or not req.tools or not config.enable_auto_tool_choice:
        return None
    return ToolPlan(PARSERS[config.tool_call_parser](template_tools(req.tools)))


def brief_choice(choice: object) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.name!r}"


class ResponsesRun:
    """A submitted Responses request: its Response object once done, or its events as they come; close() ends
    its state on every path."""

    def __init__(self, run: OpenAIRun, req: ResponsesRequest, named: FunctionTool | None, plan: ToolPlan | None):
        self.run = run
        self.req = req
        self.named = named  # tool_choice names this function: the output is its arguments
        self.plan = plan  # tool_choice auto under a tool-call parser: it reads the output's calls
        self.required = req.tool_choice == "required"  # the output is a JSON list of calls
        self.id = new_id("resp_")
        self.created_at = int(time.time())
        self.item_id = new_id("fc_" if named else "msg_")  # the item streamed as it is generated
        self.call_id = new_id("call_")
        self.writer = EventWriter()

    @property
    def stream(self) -> bool:
        return self.req.stream

    async def close(self) -> None:
        await self.run.close()

    def response(self, output: list[OutputItem], done: bool) -> ResponseObject:
        state = self.run.states[0]
        incomplete = done and self.truncated()
        usage = None
        if done:
            num_input, num_output = self.run.prompt_tokens, len(state.output_ids)
            details = InputTokensDetails(cached_tokens=state.num_cached_prompt_tokens)
            usage = ResponseUsage(input_tokens=num_input, input_tokens_details=details,
                                  output_tokens=num_output, output_tokens_details=OutputTokensDetails(),
                                  total_tokens=num_input + num_output)
        req = self.req
        return ResponseObject(
            id=self.id, created_at=self.created_at, model=self.run.base["model"],
            status="incomplete" if incomplete else "completed" if done else "in_progress",
            output=output, usage=usage,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, temperature=req.temperature,
            top_p=req.top_p, tools=req.tools, tool_choice=req.tool_choice,
            parallel_tool_calls=req.parallel_tool_calls, user=req.user,
        )

    def truncated(self) -> bool:
        reason = self.run.states[0].finish_reason
        return reason is not None and reason["type"] == "length"

    def items(self) -> list[OutputItem]:
        """The finished output: a message, the named function's call, the calls of `required` (a message with the
        text where a cut-off list does not parse), or what the tool-call parser reads (tool_choice auto)."""
        text, status = self.run.states[0].text, "incomplete" if self.truncated() else "completed"
        if self.plan is not None:
            return parsed_items(text, self.plan, status)
        if self.named is not None:
            return [FunctionCall(id=self.item_id, call_id=self.call_id, name=self.named.name, arguments=text,
                                 status=status)]
        if self.required:
            try:
                calls = json.loads(text)
            except ValueError:
                calls = None
            if isinstance(calls, list):
                return [FunctionCall(id=new_id("fc_"), call_id=new_id("call_"), name=call["name"],
                                     arguments=json.dumps(call["arguments"]), status=status) for call in calls]
        return [OutputMessage(id=self.item_id, role="assistant", status=status, content=[OutputText(text, [])])]

    async def result(self) -> ResponseObject:
        """The whole Response once generation ended; GenerationFailed if it failed."""
        await self.run.service.wait(self.run.states)
        raise_failure(self.run.states)
        return self.response(self.items(), done=True)

    async def deltas(self) -> AsyncIterator[str]:
        """The output text as it grows, piece by piece; GenerationFailed if generation fails."""
        sent = 0
        async for _, state in self.run.service.stream(self.run.states):
            raise_failure([state])
            if len(state.text) > sent:
                yield state.text[sent:]
                sent = len(state.text)

    async def events(self) -> AsyncIterator[ResponseEvent]:
        """The stream: created, in_progress, each output item's events, then completed, or incomplete where
        max_output_tokens cut it; an error event ends it where generation fails."""
        yield ResponseCreated(sequence_number=self.writer.next(), response=self.response([], done=False))
        yield ResponseInProgress(sequence_number=self.writer.next(), response=self.response([], done=False))
        try:
            if self.plan is not None:  # items as the parser finds them in the text so far
                parsed = ParsedItemsStream(self.plan, self.writer)
                text = ""
                async for piece in self.deltas():
                    text += piece
                    for event in parsed.update(text, final=False):
                        yield event
                status = "incomplete" if self.truncated() else "completed"
                for event in parsed.update(text, final=True) + parsed.finish(status):
                    yield event
                items = parsed.items
            elif self.required:  # the calls are known once their JSON list is whole
                async for _ in self.deltas():
                    pass
                items = self.items()
                for index, item in enumerate(items):
                    for event in self.writer.opening(index, item):
                        yield event
                    yield self.writer.delta(index, item, item.arguments if isinstance(item, FunctionCall) else
                                            item.content[0].text)
                    for event in self.writer.closing(index, item):
                        yield event
            else:
                shell = (FunctionCall(id=self.item_id, call_id=self.call_id, name=self.named.name, arguments="",
                                      status="in_progress") if self.named else
                         OutputMessage(id=self.item_id, role="assistant", status="in_progress", content=[]))
                for event in self.writer.opening(0, shell):
                    yield event
                async for piece in self.deltas():
                    yield self.writer.delta(0, shell, piece)
                items = self.items()
                for event in self.writer.closing(0, items[0]):
                    yield event
        except GenerationFailed as e:
            yield ErrorEvent(sequence_number=self.writer.next(), code=str(e.status), message=str(e))
            return
        final = self.response(items, done=True)
        closing = ResponseIncomplete if final.status == "incomplete" else ResponseCompleted
        yield closing(sequence_number=self.writer.next(), response=final)


async def start_response(service: GenerateService, req: ResponsesRequest) -> ResponsesRun:
    """Validate and submit: the prompt through the chat template with the tools, generated as a chat request."""
    messages = chat_of(input_items(req.input), req.instructions)
    found, named = forced_call(req)
    if found is not None and req.structured_outputs is not None:
        raise InputError(f"tool_choice {brief_choice(req.tool_choice)} forces the output's shape: structured_outputs "
                         "cannot be given with it")
    plan = auto_plan(req, service.runtime.config)
    lora_name, _ = await service.resolve_model(req.model)  # an adapter with its own tokenizer renders with it
    prompt = service.tokenize_chat(messages, ChatOptions(tools=template_tools(req.tools)), lora_name)
    chat = ChatRequest(model=req.model, messages=[], max_tokens=req.max_output_tokens, temperature=req.temperature,
                       top_p=req.top_p, stream=req.stream, user=req.user, structured_outputs=req.structured_outputs)
    run = await start_openai(service, chat, [prompt], chat=True, default_max=None, found=found, tools=plan)
    return ResponsesRun(run, req, named, plan)
