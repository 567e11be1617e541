"""What every tool-call parser shares: a call's shape, the split of a text into content and calls, and the rule for
streaming — content is sent only once it cannot be the start of a call; a call once its name is known, its arguments
as they are written (formats that keep them as JSON text) or once it is complete (the others)."""

from __future__ import annotations

import json
from typing import Any, NamedTuple


class ToolCall(NamedTuple):
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it
    id: str | None = None  # the model's own id for the call (Kimi K2's `functions.NAME:IDX`); None: one is made


class PartialCall(NamedTuple):
    """A call still being written: its name, its arguments' JSON text so far, and the model's id for it if any."""

    name: str
    arguments: str
    id: str | None = None


class Parsed(NamedTuple):
    content: str  # the text before the calls
    calls: list[ToolCall]  # the complete ones
    partial: PartialCall | None = None  # while streaming: the call being written, where its format streams


def arguments_text(value: Any) -> str:
    """A call's arguments as OpenAI's JSON text: an object is dumped, a text (some models write one) kept."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of text could be the start of marker (held back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolParser:
    """Splits a model's text into content and tool calls. Subclasses set `marker` (the text that opens the calls)
    and implement calls(); those whose calls open the output itself override find_start and hold."""

    marker = ""
    # the marker is a special token, which the detokenizer would skip (vLLM's parser turns skipping off too)
    needs_special_tokens = False

    def __init__(self, tools: list[dict]):
        # name -> the function's JSON schema of parameters (some formats type their values by it)
        self.parameters = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}

    def parse(self, text: str) -> Parsed:
        """The whole output, once: the calls, or (none found, or none parse) all of it as content."""
        return self.parse_prefix(text, final=True)

    def parse_prefix(self, text: str, final: bool) -> Parsed:
        """A text so far (final: the whole output). Not final: the content that can be sent (never the start of a
        call) and the calls complete so far; each answer extends the one before."""
        start = self.find_start(text)
        if start < 0:
            return Parsed(text if final else text[: len(text) - self.hold(text)], [])
        calls, partial = self.calls(text[start:], final)
        if final and not calls:  # nothing parses: the model's text is the answer, as vLLM gives it
            return Parsed(text, [])
        return Parsed(text[:start], calls, None if final else partial)

    def find_start(self, text: str) -> int:
        return text.find(self.marker)

    def hold(self, text: str) -> int:
        return held_back(text, self.marker)

    def calls(self, region: str, final: bool) -> tuple[list[ToolCall], PartialCall | None]:
        """The calls in region (from the start of the calls on): the complete ones (final: every one that parses),
        and the one being written where the format streams its arguments."""
        raise NotImplementedError


class LeadingParser(ToolParser):
    """Formats whose calls are the whole output: they open it (after blanks) with `opener` or a `marker` token."""

    opener = ""

    def find_start(self, text: str) -> int:
        body = text.lstrip()
        blanks = len(text) - len(body)
        return blanks if body.startswith(self.opener) or (self.marker and body.startswith(self.marker)) else -1

    def hold(self, text: str) -> int:
        body = text.lstrip()
        undecided = not body or (self.marker and self.marker.startswith(body))
        return len(text) if undecided else 0

    def strip_marker(self, region: str) -> str:
        return region[len(self.marker) :] if self.marker and region.startswith(self.marker) else region
