"""Llama 3.1-3.3 JSON calls: the output is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `;`."""

from __future__ import annotations

from loraplex.frontend.tools.base import LeadingParser, ToolCall, json_call, json_values


class Llama3JsonParser(LeadingParser):
    opener = "{"
    marker = "<|python_tag|>"

    def calls(self, region: str, final: bool) -> list[ToolCall]:
        values, _ = json_values(self.strip_marker(region).strip(), separators=";")
        return [call for call in map(json_call, values) if call is not None]
