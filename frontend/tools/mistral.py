"""Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (the JSON-list form of its older templates), or
`[TOOL_CALLS]name[ARGS]{...}` repeated (its v11+ tokenizers: Mistral Small 3.2, Devstral)."""

from __future__ import annotations

from loraplex.frontend.tools.base import PartialCall, ToolCall
from loraplex.frontend.tools.json_calls import HeadedParser, json_calls


class MistralParser(HeadedParser):
    marker = "[TOOL_CALLS]"
    call_begin = "[TOOL_CALLS]"
    separator = "[ARGS]"
    needs_special_tokens = True

    def calls(self, region: str, final: bool) -> tuple[list[ToolCall], PartialCall | None]:
        body = region[len(self.marker) :].lstrip()
        if body.startswith("["):
            return json_calls(body[1:].rstrip().removesuffix("]"))
        return super().calls(region, final)
