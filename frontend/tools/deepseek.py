"""DeepSeek-V3 / V3.1 calls (`deepseek_v3`): `<｜tool▁calls▁begin｜>`, then per call `<｜tool▁call▁begin｜>` HEAD
`<｜tool▁sep｜>` ... `<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`. V3 (and V3-0324) write the type as the head
and the arguments in a fenced block, `function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n````; V3.1 the name as the head and
the arguments' JSON right after the separator, `NAME<｜tool▁sep｜>{...}`. Arguments stream as they are written."""

from __future__ import annotations

import re

from loraplex.frontend.tools.json_calls import HeadedParser

V3_NAME = re.compile(r"\s*([^\s`]+)[ \t]*\n```(?:json)?[ \t]*\n?")  # V3: the name, then the fence that opens the object


class DeepSeekV3Parser(HeadedParser):
    marker = "<｜tool▁calls▁begin｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    separator = "<｜tool▁sep｜>"
    needs_special_tokens = True  # the call markup is added tokens, which a detokenizer may skip

    def read_head(self, head: str, rest: str) -> tuple[str, str | None, str] | None:
        if head.strip() == "function" and (fenced := V3_NAME.match(rest)) is not None:
            return fenced[1], None, rest[fenced.end() :]
        return super().read_head(head, rest)
