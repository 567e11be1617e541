"""Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (the JSON-list form of its older templates), or
`[TOOL_CALLS]name[ARGS]{...}` repeated (its v11+ tokenizers: Mistral Small 3.2, Devstral)."""

from __future__ import annotations

import json

from loraplex.frontend.tools.base import ToolCall, ToolParser, arguments_text, json_call, json_values

ARGS = "[ARGS]"


class MistralParser(ToolParser):
    marker = "[TOOL_CALLS]"
    needs_special_tokens = True

    def calls(self, region: str, final: bool) -> list[ToolCall]:
        body = region[len(self.marker) :].lstrip()
        if body.startswith("["):
            items, _ = json_values(body[1:].rstrip().removesuffix("]"))
            return [call for call in map(json_call, items) if call is not None]
        return named_calls(region.split(self.marker)[1:])


def named_calls(blocks: list[str]) -> list[ToolCall]:
    """`name[ARGS]{...}` blocks: each call whose arguments are a complete JSON value."""
    calls = []
    for block in blocks:
        name, found, rest = block.partition(ARGS)
        if not found:
            break
        try:
            value, _ = json.JSONDecoder().raw_decode(rest.lstrip())
        except ValueError:
            break  # still being written (or not JSON: the calls end here)
        calls.append(ToolCall(name.strip(), arguments_text(value)))
    return calls
