"""gpt-oss's harmony calls (`openai`): a message to `functions.NAME` on the commentary channel, its body the arguments'
JSON, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>` (the recipient may also
stand before `<|channel|>`); frontend/harmony.py reads the messages.

A call is complete at its end token, or at the output's end (`<|call|>` is a stop token, so usually not in the text),
and is a call when its body is a JSON object; otherwise (another recipient, arguments that do not parse, a call cut by
max_tokens) the message comes back as content as the model wrote it. The other messages' bodies are content: the
final channel's (and, without --reasoning-parser openai_gptoss, the analysis channel's too). While streaming, the call
being written streams its arguments as they are written (they are JSON text)."""

from __future__ import annotations

import json

from loraplex.frontend.harmony import segments
from loraplex.frontend.tools.base import Parsed, PartialCall, ToolCall, ToolParser

FUNCTIONS = "functions."


class HarmonyParser(ToolParser):
    # the channel and call markup are special tokens, which the detokenizer would skip
    needs_special_tokens = True

    def parse_prefix(self, text: str, final: bool) -> Parsed:
        content, calls = [], []
        for segment in segments(text, final)[0]:
            if not segment.recipient:
                content.append(segment.body)
            elif not segment.closed:  # the call being written: the last thing in the text
                return Parsed("".join(content), calls, partial_call(segment.recipient, segment.body))
            elif (call := whole_call(segment.recipient, segment.body)) is not None:
                calls.append(call)
            else:
                content.append(segment.raw)
        return Parsed("".join(content), calls)


def whole_call(recipient: str, body: str) -> ToolCall | None:
    if not recipient.startswith(FUNCTIONS):
        return None
    try:
        arguments = json.loads(body)
    except ValueError:
        return None
    return ToolCall(recipient.removeprefix(FUNCTIONS), body.strip()) if isinstance(arguments, dict) else None


def partial_call(recipient: str, body: str) -> PartialCall | None:
    arguments = body.strip()
    if not recipient.startswith(FUNCTIONS) or not arguments.startswith("{"):
        return None
    return PartialCall(recipient.removeprefix(FUNCTIONS), arguments)
