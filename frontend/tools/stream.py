"""One choice's tool calls, whole (tool_answer) or streamed (ToolCallStream). Streamed: the text so far in,
OpenAI's deltas out — content as it becomes safe to send, then per call a delta with its index, id (the model's own
where its format writes one, else a new `call_` id), type and function name (arguments ""), then its arguments: in
one piece once the call is complete (whole_calls, chat), or in pieces as they are written where the format keeps them
as JSON text (hermes, llama3_json, mistral, deepseek_v3, kimi_k2; the Responses API, whose items can close
incomplete). A call cut by max_tokens never goes out as a call with whole_calls: its text ends up as content, as in
the whole answer."""

from __future__ import annotations

import uuid

from loraplex.frontend.bodies import FunctionCall, FunctionCallDelta, ToolCallDelta, ToolCallItem
from loraplex.frontend.tools.base import PartialCall, ToolCall
from loraplex.frontend.tools.request import ToolPlan

Deltas = list[tuple[str, list[ToolCallDelta]]]  # (content piece, tool call deltas), one chunk each


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call_item(call: ToolCall) -> ToolCallItem:
    """A call in a response's message.tool_calls."""
    return ToolCallItem(id=call.id or call_id(), type="function",
                        function=FunctionCall(name=call.name, arguments=call.arguments))


def header_delta(index: int, name: str, model_id: str | None = None) -> ToolCallDelta:
    return ToolCallDelta(index=index, id=model_id or call_id(), type="function",
                         function=FunctionCallDelta(name=name, arguments=""))


def arguments_delta(index: int, piece: str) -> ToolCallDelta:
    return ToolCallDelta(index=index, function=FunctionCallDelta(arguments=piece))


class ToolCallStream:
    def __init__(self, plan: ToolPlan, whole_calls: bool):
        self.plan = plan
        # A chat delta cannot be taken back, and clients assemble whatever pieces came (a cut call would look
        # complete), so chat sends a call only once it parses; the whole answer and the stream then always agree.
        self.whole_calls = whole_calls
        self.num_content = 0  # content characters sent
        self.num_calls = 0  # complete calls sent whole
        self.open_call: int | None = None  # the call being written whose head went out
        self.num_arguments = 0  # argument characters of the open call sent

    @property
    def has_calls(self) -> bool:
        return self.num_calls > 0 or self.open_call is not None

    def update(self, text: str, final: bool) -> Deltas:
        """The deltas the text so far adds, each (content piece, tool call deltas), in order; final: the output is
        complete."""
        content, calls, partial = self.plan.parser.parse_prefix(text, final)
        out: Deltas = []
        if len(content) > self.num_content:
            out.append((content[self.num_content :], []))
            self.num_content = len(content)
        for index in range(self.num_calls, len(calls)):
            out += self._arguments(index, calls[index])
            self.open_call = None
        self.num_calls = len(calls)
        if partial is not None and not self.whole_calls:
            out += self._arguments(len(calls), partial)
        return out

    def _arguments(self, index: int, call: ToolCall | PartialCall) -> Deltas:
        """Call `index` so far: its head once, then what its arguments add (they only ever grow)."""
        out: Deltas = []
        name, arguments = call.name, call.arguments
        if self.open_call != index:
            out.append(("", [header_delta(index, name, call.id)]))
            self.open_call, self.num_arguments = index, 0
        if len(arguments) > self.num_arguments:
            out.append(("", [arguments_delta(index, arguments[self.num_arguments :])]))
            self.num_arguments = len(arguments)
        return out


def tool_answer(text: str, plan: ToolPlan | None) -> tuple[str | None, list[ToolCallItem]]:
    """A whole output as a message's content and tool_calls (content null when the answer is calls alone)."""
    if plan is None:
        return text, []
    content, calls, _ = plan.parser.parse(text)
    if not calls:  # the text (harmony: its markup read off), as the stream sends it
        return content, []
    return (content if content.strip() else None), [tool_call_item(call) for call in calls]
