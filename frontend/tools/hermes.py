"""Hermes (Qwen2.5, Hermes, many fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated."""

from __future__ import annotations

from loraplex.frontend.tools.base import PartialCall, ToolCall, ToolParser
from loraplex.frontend.tools.json_calls import json_call, partial_call

END = "</tool_call>"


class HermesParser(ToolParser):
    marker = "<tool_call>"

    def calls(self, region: str, final: bool) -> tuple[list[ToolCall], PartialCall | None]:
        calls = []
        for block in region.split(self.marker)[1:]:
            body, closed, _ = block.partition(END)
            if not closed and not final:
                return calls, partial_call(body)  # still being written
            call = json_call(body)
            if call is not None:
                calls.append(call)
        return calls, None
