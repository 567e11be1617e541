"""Calls written as JSON objects, `{"name": ..., "arguments" | "parameters": {...}}` (hermes, llama3_json, mistral,
forced `required`): read one after another, each call's arguments kept as the model wrote them, so a call still being
written streams its arguments and the pieces add up to the finished call's."""

from __future__ import annotations

import json
import re
from typing import Any

from loraplex.frontend.tools.base import PartialCall, ToolCall, arguments_text

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
