"""Llama 3.1-3.3 JSON calls: the output is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several separated by `;`."""

from __future__ import annotations

from loraplex.frontend.tools.base import LeadingParser, PartialCall, ToolCall
from loraplex.frontend.tools.json_calls import json_calls


class Llama3JsonParser(LeadingParser):
    opener = "{"
    marker = "<|python_tag|>"

    def calls(self, region: str, final: bool) -> tuple[list[ToolCall], PartialCall | None]:
        return json_calls(self.strip_marker(region), separators=";")
