"""tool_choice `required` and a named function: the output is forced by a JSON-schema grammar, so it always parses.

Named: the output is the function's arguments object itself. Required: `{"name": ..., "parameters": {...}}` for one
of the tools, or a list of one or more of them when parallel_tool_calls is on (vLLM's shapes)."""

from __future__ import annotations

import json
from typing import Any

from loraplex.frontend.tools.base import Parsed, PartialCall, ToolCall, ToolParser
from loraplex.frontend.tools.json_calls import json_calls

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def call_schema(tool: dict) -> dict:
    function = tool["function"]
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "parameters": function.get("parameters") or ANY_OBJECT},
            "required": ["name", "parameters"], "additionalProperties": False}


def required_schema(tools: list[dict], parallel: bool) -> dict:
    one = {"anyOf": [call_schema(t) for t in tools]} if len(tools) > 1 else call_schema(tools[0])
    return {"type": "array", "items": one, "minItems": 1} if parallel else one


def named_schema(tool: dict) -> dict:
    return tool["function"].get("parameters") or ANY_OBJECT


class NamedParser(ToolParser):
    """The whole output is one call's arguments: a call once it parses, else (cut by max_tokens) text."""

    def __init__(self, tools: list[dict], name: str):
        super().__init__(tools)
        self.name = name

    def parse_prefix(self, text: str, final: bool) -> Parsed:
        if not final:
            return Parsed("", [])
        try:
            json.loads(text)
        except ValueError:  # cut by max_tokens: the text as it is
            return Parsed(text, [])
        return Parsed("", [ToolCall(self.name, text.strip())])


class RequiredParser(ToolParser):
    """`{"name", "parameters"}`, or a list of them (parallel)."""

    def __init__(self, tools: list[dict], parallel: bool):
        super().__init__(tools)
        self.parallel = parallel

    def find_start(self, text: str) -> int:
        return 0

    def calls(self, region: str, final: bool) -> tuple[list[ToolCall], PartialCall | None]:
        # Calls only once the whole output parses: a list cut by max_tokens is text, even where calls before the
        # cut are complete (the list might have gone on), as a cut named call is.
        try:
            json.loads(region)
        except ValueError:
            return [], None
        body = region.strip()
        if self.parallel:
            if not body.startswith("["):
                return [], None
            body = body[1:].rstrip().removesuffix("]")
        return json_calls(body, ("parameters",))
