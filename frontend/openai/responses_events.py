"""The streamed events of a Response's output items: each item opened, grown and closed in the order the `openai`
client's `responses.stream` assembles them (EventWriter), and the items a tool-call parser reads from the text as it
grows (ParsedItemsStream: tool_choice auto under --tool-call-parser)."""

from __future__ import annotations

import itertools
import uuid

import msgspec
from loraplex.frontend.openai.responses_schemas import (
    ArgumentsDelta,
    ArgumentsDone,
    ContentPartAdded,
    ContentPartDone,
    FunctionCall,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    ResponseEvent,
)
from loraplex.frontend.tools.request import ToolPlan
from loraplex.frontend.tools.stream import ToolCallStream, tool_answer


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class EventWriter:
    """Numbers the events of one stream (sequence_number from 0) and writes an item's opening, pieces and closing."""

    def __init__(self):
        self.sequence = itertools.count()

    def next(self) -> int:
        return next(self.sequence)

    def opening(self, index: int, item: OutputItem) -> list[ResponseEvent]:
        if isinstance(item, FunctionCall):
            shell = msgspec.structs.replace(item, arguments="", status="in_progress")
            return [OutputItemAdded(sequence_number=self.next(), output_index=index, item=shell)]
        shell = msgspec.structs.replace(item, content=[], status="in_progress")
        return [OutputItemAdded(sequence_number=self.next(), output_index=index, item=shell),
                ContentPartAdded(sequence_number=self.next(), item_id=item.id, output_index=index,
                                 content_index=0, part=OutputText("", []))]

    def delta(self, index: int, item: OutputItem, piece: str) -> ResponseEvent:
        if isinstance(item, FunctionCall):
            return ArgumentsDelta(sequence_number=self.next(), item_id=item.id, output_index=index, delta=piece)
        return OutputTextDelta(sequence_number=self.next(), item_id=item.id, output_index=index, content_index=0,
                               delta=piece)

    def closing(self, index: int, item: OutputItem) -> list[ResponseEvent]:
        if isinstance(item, FunctionCall):
            return [ArgumentsDone(sequence_number=self.next(), item_id=item.id, output_index=index,
                                  name=item.name, arguments=item.arguments),
                    OutputItemDone(sequence_number=self.next(), output_index=index, item=item)]
        part = item.content[0]
        return [OutputTextDone(sequence_number=self.next(), item_id=item.id, output_index=index,
                               content_index=0, text=part.text),
                ContentPartDone(sequence_number=self.next(), item_id=item.id, output_index=index,
                                content_index=0, part=part),
                OutputItemDone(sequence_number=self.next(), output_index=index, item=item)]


def parsed_items(text: str, plan: ToolPlan, last_status: str) -> list[OutputItem]:
    """A whole output read by the parser: its content as a message (left out when blank and there are calls), then a
    function_call per call; only the last item can be cut by max_output_tokens (last_status)."""
    content, calls = tool_answer(text, plan)
    items: list[OutputItem] = []
    if content is not None:
        items.append(msgspec.structs.replace(new_message(), status="completed", content=[OutputText(content, [])]))
    items += [FunctionCall(id=new_id("fc_"), call_id=call.id, name=call.function.name,
                           arguments=call.function.arguments, status="completed") for call in calls]
    items[-1].status = last_status
    return items


def new_message() -> OutputMessage:
    return OutputMessage(id=new_id("msg_"), role="assistant", status="in_progress", content=[OutputText("", [])])


class ParsedItemsStream:
    """parsed_items as the text grows: a message opens once its content has more than blanks, a function_call
    item per call as its name is known (closing the item before), its arguments as the parser gives them.
    `items` holds what went out, closed ones final, for the closing Response."""

    def __init__(self, plan: ToolPlan, writer: EventWriter):
        self.calls = ToolCallStream(plan, whole_calls=False)
        self.writer = writer
        self.items: list[OutputItem] = []
        self.is_open = False  # the last item is still being written
        self.blank = ""  # leading content that is blank so far, held until text follows or the output ends

    def update(self, text: str, final: bool) -> list[ResponseEvent]:
        """The events the output so far adds (final: it is complete)."""
        events: list[ResponseEvent] = []
        for content, deltas in self.calls.update(text, final):
            if content:
                events += self._content(content)
            for delta in deltas:
                if delta.id is not None:  # a new call: its name and call id
                    events += self._open(FunctionCall(id=new_id("fc_"), call_id=delta.id, name=delta.function.name,
                                                      arguments="", status="in_progress"))
                elif delta.function.arguments:
                    call = self.items[-1]
                    call.arguments += delta.function.arguments
                    events.append(self.writer.delta(len(self.items) - 1, call, delta.function.arguments))
        return events

    def finish(self, status: str) -> list[ResponseEvent]:
        """Close the last item (status: cut by max_output_tokens or not); an output that gave none is a message."""
        events = []
        if not self.items:
            events += self._content(self.blank, force=True)
        return events + self._close(status)

    def _content(self, piece: str, force: bool = False) -> list[ResponseEvent]:
        events = []
        if not self.items:  # content comes first, before any call
            self.blank += piece
            if not (force or self.blank.strip()):
                return []
            piece, self.blank = self.blank, ""
            events += self._open(new_message())
        elif isinstance(self.items[-1], FunctionCall):
            # At the end the calls did not parse (cut, or malformed), so their text is content after all: the call
            # stays as far as it went, incomplete, and the text follows as a message (the whole answer is that text).
            events += self._open(new_message(), closing="incomplete")
        message = self.items[-1]
        if piece:
            message.content[0].text += piece
            events.append(self.writer.delta(len(self.items) - 1, message, piece))
        return events

    def _open(self, item: OutputItem, closing: str = "completed") -> list[ResponseEvent]:
        """Close the last item (with status `closing`) and open this one."""
        events = self._close(closing)
        self.items.append(item)
        self.is_open = True
        return events + self.writer.opening(len(self.items) - 1, item)

    def _close(self, status: str) -> list[ResponseEvent]:
        if not self.is_open:
            return []
        self.is_open = False
        self.items[-1].status = status
        return self.writer.closing(len(self.items) - 1, self.items[-1])
