"""Pythonic calls (Llama 3.2 / 4, ToolACE; `pythonic` and `llama4_pythonic`): the output is a Python list of calls,
`[f(a=1), g(b="x")]`, keyword arguments as Python literals (optionally between `<|python_start|>` and
`<|python_end|>`, as Llama 4 writes it)."""

from __future__ import annotations

import ast
import json

from loraplex.frontend.tools.base import LeadingParser, PartialCall, ToolCall

END = "<|python_end|>"
CLOSERS = {"(": ")", "[": "]", "{": "}"}


class PythonicParser(LeadingParser):
    opener = "["
    marker = "<|python_start|>"

    def calls(self, region: str, final: bool) -> tuple[list[ToolCall], PartialCall | None]:
        # Python literals are turned into JSON whole: a call's arguments go out in one piece.
        body = self.strip_marker(region).strip().removesuffix(END).strip()
        calls = []
        for piece in complete_items(body):
            call = literal_call(piece)
            if call is None:
                return (calls if not final else []), None  # not a list of calls: the text is content
            calls.append(call)
        return calls, None


def complete_items(body: str) -> list[str]:
    """The complete top-level items of a Python list written so far: `[a(...), b(...` -> ["a(...)"]."""
    if not body.startswith("["):
        return []
    items, depth, quote, start, i = [], 0, "", 1, 1
    while i < len(body):
        c = body[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in CLOSERS:
            depth += 1
        elif c in ")]}":
            if depth == 0:  # the list's own "]"
                items.append(body[start:i])
                break
            depth -= 1
        elif c == "," and depth == 0:
            items.append(body[start:i])
            start = i + 1
        i += 1
    return [item.strip() for item in items if item.strip()]


def literal_call(text: str) -> ToolCall | None:
    try:
        node = ast.parse(text, mode="eval").body
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
            return None
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    except (SyntaxError, ValueError):
        return None
    return ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False))
