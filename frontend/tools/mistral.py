"""Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (the JSON-list form of its templates)."""

from __future__ import annotations

from loraplex.frontend.tools.base import ToolCall, ToolParser, json_call, json_values


class MistralParser(ToolParser):
    marker = "[TOOL_CALLS]"

    def calls(self, region: str, final: bool) -> list[ToolCall]:
        body = region[len(self.marker) :].lstrip()
        if not body.startswith("["):
            return []
        items, _ = json_values(body[1:].rstrip().removesuffix("]"))
        return [call for call in map(json_call, items) if call is not None]
