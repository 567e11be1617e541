"""Hermes (Qwen2.5, Hermes, many fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated."""

from __future__ import annotations

import json

from loraplex.frontend.tools.base import ToolCall, ToolParser, json_call

END = "</tool_call>"


class HermesParser(ToolParser):
    marker = "<tool_call>"

    def calls(self, region: str, final: bool) -> list[ToolCall]:
        calls = []
        for block in region.split(self.marker)[1:]:
            body, closed, _ = block.partition(END)
            if not closed and not final:
                break  # still being written
            try:
                call = json_call(json.loads(body))
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
        return calls
