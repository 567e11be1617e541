"""One choice's tool calls, whole (tool_answer) or streamed (ToolCallStream). Streamed: the text so far in,
OpenAI's deltas out — content as it becomes safe to send, then per call a delta with its index, id, type and function
name (arguments ""), then its arguments in pieces. A named tool_choice streams its arguments token by token; a parsed
call's arguments go out once the call is complete."""

from __future__ import annotations

import uuid

from loraplex.frontend.responses import FunctionCall, FunctionCallDelta, ToolCallDelta, ToolCallItem
from loraplex.frontend.tools.base import ToolCall
from loraplex.frontend.tools.request import ToolPlan

Deltas = list[tuple[str, list[ToolCallDelta]]]  # (content piece, tool call deltas), one chunk each


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call_item(call: ToolCall) -> ToolCallItem:
    """A call in a response's message.tool_calls."""
    return ToolCallItem(id=call_id(), type="function", function=FunctionCall(name=call.name, arguments=call.arguments))


def header_delta(index: int, name: str) -> ToolCallDelta:
    return ToolCallDelta(index=index, id=call_id(), type="function",
                         function=FunctionCallDelta(name=name, arguments=""))


def arguments_delta(index: int, piece: str) -> ToolCallDelta:
    return ToolCallDelta(index=index, function=FunctionCallDelta(arguments=piece))


class ToolCallStream:
    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.num_content = 0  # content characters sent
        self.num_calls = 0  # calls sent
        self.num_arguments = 0  # named choice: argument characters sent

    @property
    def has_calls(self) -> bool:
        return self.num_calls > 0

    def update(self, text: str, final: bool) -> Deltas:
        """The deltas the text so far adds, each (content piece, tool call deltas), in order; final: the output is
        complete."""
        if self.plan.named is not None:
            return self._named(text, final)
        content, calls = self.plan.parser.parse_prefix(text, final)
        out: Deltas = []
        if len(content) > self.num_content:
            out.append((content[self.num_content :], []))
            self.num_content = len(content)
        for index in range(self.num_calls, len(calls)):
            out.append(("", [header_delta(index, calls[index].name)]))
            out.append(("", [arguments_delta(index, calls[index].arguments)]))
        self.num_calls = len(calls)
        return out

    def _named(self, text: str, final: bool) -> Deltas:
        # The grammar makes every token part of the arguments; one cut by max_tokens stays a cut call, as vLLM's.
        out: Deltas = []
        if not self.num_calls:
            out.append(("", [header_delta(0, self.plan.named)]))
            self.num_calls = 1
        piece = text[self.num_arguments :]
        if piece:
            out.append(("", [arguments_delta(0, piece)]))
            self.num_arguments = len(text)
        return out


def tool_answer(text: str, plan: ToolPlan | None) -> tuple[str | None, list[ToolCallItem]]:
    """A whole output as a message's content and tool_calls (content null when the answer is calls alone)."""
    if plan is None:
        return text, []
    content, calls = plan.parser.parse(text)
    if not calls:
        return text, []
    return (content if content.strip() else None), [tool_call_item(call) for call in calls]
