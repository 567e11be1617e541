"""Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (the JSON-list form of its older templates), or
`[TOOL_CALLS]name[ARGS]{...}` repeated (its v11+ tokenizers: Mistral Small 3.2, Devstral)."""

from __future__ import annotations

from loraplex.frontend.tools.base import PartialCall, ToolCall, ToolParser
from loraplex.frontend.tools.json_calls import json_calls, value_end

ARGS = "[ARGS]"


class MistralParser(ToolParser):
    marker = "[TOOL_CALLS]"
    needs_special_tokens = True

    def calls(self, region: str, final: bool) -> tuple[list[ToolCall], PartialCall | None]:
        body = region[len(self.marker) :].lstrip()
        if body.startswith("["):
            return json_calls(body[1:].rstrip().removesuffix("]"))
        return named_calls(region.split(self.marker)[1:])


def named_calls(blocks: list[str]) -> tuple[list[ToolCall], PartialCall | None]:
    """`name[ARGS]{...}` blocks: the calls whose arguments are complete JSON, and the one being written."""
    calls = []
    for block in blocks:
        name, found, rest = block.partition(ARGS)
        rest = rest.lstrip()
        if not found or not rest.startswith("{"):
            return calls, None
        end = value_end(rest, 0)
        if end < 0:
            return calls, PartialCall(name.strip(), rest)
        calls.append(ToolCall(name.strip(), rest[:end]))
    return calls, None
