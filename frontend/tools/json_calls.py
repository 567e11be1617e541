"""Calls written as JSON objects, `{"name": ..., "arguments" | "parameters": {...}}` (hermes, llama3_json, mistral,
forced `required`): read one after another, each call's arguments kept as the model wrote them, so a call still being
written streams its arguments and the pieces add up to the finished call's. HeadedParser: calls written as a head
(the name, maybe an id) and then the arguments' JSON object (mistral's v11 form, deepseek_v3, kimi_k2)."""

from __future__ import annotations

import json
import re
from typing import Any

from loraplex.frontend.tools.base import PartialCall, ToolCall, ToolParser, arguments_text

KEYS = ("arguments", "parameters")
# A call's head: its name first, then its arguments' key (another order is read whole, never streamed).
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(\w+)"\s*:\s*')


def value_end(text: str, start: int) -> int:
    """The index just past the JSON object or array that opens at text[start]; -1 while it is still cut."""
    depth, in_string, i = 0, False, start
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def raw_arguments(text: str, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, the arguments' text so far) of a call whose head is written and whose arguments object has begun."""
    head = HEAD.match(text)
    if head is None or head.group(2) not in keys or not text[head.end() :].startswith(("{", "[")):
        return None
    end = value_end(text, head.end())
    return json.loads(f'"{head.group(1)}"'), text[head.end() : end if end >= 0 else len(text)]


def json_call(text: str, keys: tuple[str, ...] = KEYS) -> ToolCall | None:
    """One complete JSON value's text as a call (None: not JSON, or not a call)."""
    try:
        obj: Any = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in keys if k in obj), None)
    value = obj[key] if key else {}
    raw = raw_arguments(text, (key,)) if key and isinstance(value, dict | list) else None
    return ToolCall(obj["name"], raw[1] if raw else arguments_text(value))


def partial_call(text: str, keys: tuple[str, ...] = KEYS) -> PartialCall | None:
    raw = raw_arguments(text, keys)
    return None if raw is None else PartialCall(*raw)


def json_calls(text: str, keys: tuple[str, ...] = KEYS, separators: str = ",;"
               ) -> tuple[list[ToolCall], PartialCall | None]:  # fmt: skip
    """The calls one after another at the start of text (blanks and separators between them): the complete ones, and
    the one still being written."""
    decoder = json.JSONDecoder()
    calls, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return calls, None
        try:
            _, end = decoder.raw_decode(text, i)
        except ValueError:
            return calls, partial_call(text[i:], keys)
        call = json_call(text[i:end], keys)
        if call is not None:
            calls.append(call)
        i = end


def leading_object(text: str) -> tuple[str, bool] | None:
    """The JSON object that opens text (after blanks): (its text so far, whether it is closed); None: none opens it."""
    text = text.lstrip()
    if not text.startswith("{"):
        return None
    end = value_end(text, 0)
    return (text, False) if end < 0 else (text[:end], True)


def is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class HeadedParser(ToolParser):
    """Calls each opened by `call_begin`, then a head, `separator`, and the arguments' JSON object (what follows the
    object up to the next call is markup). A call is complete once its object closes, and streams its arguments as
    they are written until then; a head that does not read, or arguments that are not an object, end the calls."""

    call_begin = ""
    separator = ""

    def calls(self, region: str, final: bool) -> tuple[list[ToolCall], PartialCall | None]:
        calls = []
        for block in region.split(self.call_begin)[1:]:
            head, found, rest = block.partition(self.separator)
            read = self.read_head(head, rest) if found else None
            arguments = leading_object(read[2]) if read is not None else None
            if arguments is None:  # still being written, or not a call
                return calls, None
            (name, call_id, _), (text, closed) = read, arguments
            if not closed:
                return calls, PartialCall(name, text, call_id)
            if not is_object(text):
                return calls, None
            calls.append(ToolCall(name, text, call_id))
        return calls, None

    def read_head(self, head: str, rest: str) -> tuple[str, str | None, str] | None:
        """(name, the model's id for the call or None, the text where the arguments start); None: no call's head."""
        name = head.strip()
        return (name, None, rest) if name and not any(c.isspace() for c in name) else None
