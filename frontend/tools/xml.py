"""Qwen3-Coder's XML calls: `<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>`.
A value is text; it is read as the tool's schema types that parameter (a string stays text, anything else is read as
JSON, and kept as text where it is not JSON)."""

from __future__ import annotations

import json
import re
from typing import Any

from loraplex.frontend.tools.base import PartialCall, ToolCall, ToolParser, arguments_text

FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class XmlParser(ToolParser):
    marker = "<tool_call>"

    def calls(self, region: str, final: bool) -> tuple[list[ToolCall], PartialCall | None]:
        # A call is complete once its </function> is written (</tool_call> may never come before the end); its
        # values are typed whole, so its arguments go out in one piece.
        return [ToolCall(name.strip(), arguments_text(self.arguments(name.strip(), body)))
                for name, body in FUNCTION.findall(region)], None

    def arguments(self, name: str, body: str) -> dict[str, Any]:
        schema = self.parameters.get(name, {}).get("properties", {})
        return {key.strip(): typed(value, schema.get(key.strip(), {})) for key, value in PARAMETER.findall(body)}


def typed(raw: str, schema: dict) -> Any:
    value = raw.removeprefix("\n").removesuffix("\n")
    if schema.get("type") == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value
