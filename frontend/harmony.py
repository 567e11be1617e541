"""gpt-oss's harmony output read as messages, for its reasoning parser (`openai_gptoss`) and its tool-call parser
(`openai`). The chat template ends with `<|start|>assistant`, so the output opens inside a message's header:

    <|channel|>analysis<|message|>...<|end|>                                  the reasoning
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>   a call
    <|start|>assistant<|channel|>final<|message|>...<|return|>                the answer

A header runs from its opener (`<|start|>`, `<|channel|>`, or ` to=` at the start of the output) to `<|message|>`; it
names the channel (`<|channel|>NAME`) and, for a call, the recipient (`to=NAME`, before or after the channel). The body
runs to `<|end|>`, `<|call|>` or `<|return|>` (a `<|start|>` also ends it). `<|call|>` and `<|return|>` are stop tokens,
so they are usually not in the text: the output's end closes its last message. Text outside any message (another
parser's plain content, which this reader is also given) is a Segment of its own.

Read while streaming (final false), every answer is the one before extended: a body leaves out its last characters
where they may begin a special token, and a header shows nothing until its `<|message|>`.
"""

from __future__ import annotations

import re
from typing import NamedTuple

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
TOKENS = (START, CHANNEL, MESSAGE, "<|constrain|>", *ENDS)
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([\w.-]+)")
RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")


class Segment(NamedTuple):
    """A message, or plain text outside any (header None, body the text)."""

    header: str | None  # from its opener to `<|message|>`, both left out; None for plain text
    body: str  # so far: a possible special token's start left out while streaming
    end: str  # the end token written ("" while open, or closed by the output's end or a `<|start|>`)
    closed: bool  # nothing more can join the body (an end token, a `<|start|>`, or the output's end)
    opener: str = ""  # the header's opening text (`<|start|>` or ""); plain text and a header's raw text rebuild it

    @property
    def is_message(self) -> bool:
        return self.header is not None

    @property
    def channel(self) -> str:
        found = CHANNEL_NAME.search(self.header or "")
        return found[1] if found else ""

    @property
    def recipient(self) -> str:
        found = RECIPIENT.search((self.header or "").replace(CHANNEL, " "))
        return found[1] if found else ""

    @property
    def raw(self) -> str:
        """The message as the model wrote it (a header without `<|start|>` gets `<|start|>assistant`, so that the
        text reads as a message wherever it is put)."""
        if self.header is None:
            return self.body
        header = (
            self.header
            if self.opener
            else "assistant" + (self.header if self.header[:1] in "< " else " " + self.header)
        )
        return START + header + MESSAGE + self.body + self.end


def held(text: str) -> int:
    """How many characters at the end of text may begin a special token."""
    at = text.find("<", max(0, len(text) - max(map(len, TOKENS)) + 1))
    while at >= 0:
        if any(t.startswith(text[at:]) for t in TOKENS):
            return len(text) - at
        at = text.find("<", at + 1)
    return 0


def segments(text: str, final: bool) -> tuple[list[Segment], str]:
    """The messages and plain text read so far, and the rest not yet readable (an unfinished header, a possible
    special token's start): empty when final, where an unfinished header is plain text."""
    out: list[Segment] = []
    i = 0
    while i < len(text):
        head = _header_at(text, i)
        if head is None:  # plain text up to the next opener
            stop = min((at for at in (text.find(START, i), text.find(CHANNEL, i)) if at >= 0), default=len(text))
            if stop == len(text) and not final:
                # the output's start may still become ` to=`; elsewhere a special token's start waits
                stop = i if i == 0 and "to=".startswith(text.lstrip()[:3]) else stop - held(text[i:])
            if stop > i:
                out.append(Segment(None, text[i:stop], "", True))
            if stop == i:
                return out, text[i:]
            i = stop
            continue
        opener, header_start = head
        header_end = text.find(MESSAGE, header_start)
        if header_end < 0:
            if final:
                out.append(Segment(None, text[i:], "", True))
                return out, ""
            return out, text[i:]
        body_start = header_end + len(MESSAGE)
        ends = [(at, t) for t in (*ENDS, START) if (at := text.find(t, body_start)) >= 0]
        if not ends:
            body = text[body_start:]
            kept = body if final else body[: len(body) - held(body)]
            out.append(Segment(text[header_start:header_end], kept, "", final, opener))
            return out, body[len(kept) :]
        at, token = min(ends)
        end = "" if token == START else token
        out.append(Segment(text[header_start:header_end], text[body_start:at], end, True, opener))
        i = at + len(end)
    return out, ""


def _header_at(text: str, i: int) -> tuple[str, int] | None:
    """(opener, where the header's text starts) when a header opens at i, else None."""
    if text.startswith(START, i):
        return START, i + len(START)
    if text.startswith(CHANNEL, i):
        return "", i
    if i == 0 and text.lstrip().startswith("to="):
        return "", 0
    return None


def split_reasoning(text: str, final: bool) -> tuple[str, str]:
    """(reasoning, content) of an output so far: the analysis channel is reasoning; a message to a recipient (a call)
    stays as written, in the content, for the tool-call parser; the other messages' bodies and plain text are
    content."""
    reasoning, content = [], []
    for segment in segments(text, final)[0]:
        if segment.recipient:
            content.append(segment.raw)
        elif segment.is_message and segment.channel == "analysis":
            reasoning.append(segment.body)
        else:
            content.append(segment.body)
    return "".join(reasoning), "".join(content)
