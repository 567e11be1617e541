"""Kimi K2 calls (`kimi_k2`): `<|tool_calls_section_begin|>`, then per call `<|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{...}<|tool_call_end|>`, then `<|tool_calls_section_end|>` (some releases write the
section markers singular, `<|tool_call_section_begin|>`). `functions.NAME:IDX` is the call's id, kept as the
response's tool call id: Kimi's template writes it back beside the tool's result. Arguments stream as they are
written."""

from __future__ import annotations

import re

from loraplex.frontend.tools.base import held_back
from loraplex.frontend.tools.json_calls import HeadedParser

MARKERS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
CALL_ID = re.compile(r"(?:functions\.)?(\S+):\d+")


class KimiK2Parser(HeadedParser):
    marker = MARKERS[0]
    call_begin = "<|tool_call_begin|>"
    separator = "<|tool_call_argument_begin|>"
    needs_special_tokens = True  # the section and call markers are special tokens

    def find_start(self, text: str) -> int:
        found = [at for at in (text.find(m) for m in MARKERS) if at >= 0]
        return min(found, default=-1)

    def hold(self, text: str) -> int:
        return max(held_back(text, m) for m in MARKERS)

    def read_head(self, head: str, rest: str) -> tuple[str, str | None, str] | None:
        call_id = CALL_ID.fullmatch(head.strip())
        return None if call_id is None else (call_id[1], call_id[0], rest)
