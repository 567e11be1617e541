"""GLM-4.5 / 4.6 calls: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>`, repeated.
Each value is text, read as xml.py reads Qwen3-Coder's: kept as text where the tool's schema types it a string, else
read as JSON where it parses (numbers, booleans, objects), else kept as text.

A call is complete at its `</tool_call>` and goes out then, its name first and its arguments (typed whole, as JSON
text) after: a delta once sent cannot be taken back, and only the closing tag shows that a block reads as a call. A
block that is not a name and key/value pairs alone is no call; a block still open at the end (cut by max_tokens) is
text."""

from __future__ import annotations

import json
import re
from typing import Any

from loraplex.frontend.tools.base import PartialCall, ToolCall, ToolParser
from loraplex.frontend.tools.xml import typed

END = "</tool_call>"
NAME = re.compile(r"\s*([^\s<]+)(?=\s|<arg_key>|\Z)")
PAIR = re.compile(r"\s*<arg_key>([^<]*)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45Parser(ToolParser):
    marker = "<tool_call>"
    # the call markup may be added special tokens in a tokenizer; the parser must see them either way
    needs_special_tokens = True

    def calls(self, region: str, final: bool) -> tuple[list[ToolCall], PartialCall | None]:
        calls = []
        for block in region.split(self.marker)[1:]:
            body, closed, _ = block.partition(END)
            if not closed:  # cut, or still being written
                return calls, None
            read = self.read(body)
            if read is not None:
                calls.append(ToolCall(read[0], json.dumps(read[1], ensure_ascii=False)))
        return calls, None

    def read(self, body: str) -> tuple[str, dict[str, Any]] | None:
        """(name, arguments) of a closed call's body; None: no name, or other text where a pair should be."""
        name = NAME.match(body)
        if name is None:
            return None
        schema = self.parameters.get(name[1], {}).get("properties", {})
        arguments, at = {}, name.end()
        while (pair := PAIR.match(body, at)) is not None:
            key = pair[1].strip()
            arguments[key] = typed(pair[2], schema.get(key, {}))
            at = pair.end()
        return None if body[at:].strip() else (name[1], arguments)
