"""A chat request's tools, tool_choice and parallel_tool_calls (OpenAI's shapes, strict), and what they mean for its
output: a ToolPlan — the parser that reads the calls, and the grammar that forces them (tool_choice required or
named)."""

from __future__ import annotations

import json
from typing import Literal

import msgspec
from loraplex.frontend.errors import InputError
from loraplex.frontend.params import Strict
from loraplex.frontend.tools.base import ToolParser
from loraplex.frontend.tools.forced import NamedParser, RequiredParser, named_schema, required_schema
from loraplex.frontend.tools.parsers import PARSERS
from loraplex.protocol.structs import OutputConstraint


class FunctionDef(Strict, kw_only=True, omit_defaults=True):  # unset: not passed on
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # forced calls always follow the schema in full; parsed ones are not checked


class Tool(Strict, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolPlan(msgspec.Struct, frozen=True):
    """How a request's output becomes tool calls: parser reads them; constraint (forced choices) makes the output
    parse, unless max_tokens cuts it."""

    parser: ToolParser
    constraint: OutputConstraint | None = None


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as a chat template takes them (`tools=` of apply_chat_template), with tool_choice none too."""
    return None if tools is None else [msgspec.to_builtins(t) for t in tools]


def tool_plan(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None, auto_parser: str | None
              ) -> ToolPlan | None:  # fmt: skip
    """None: the output is plain text. auto_parser: the `--tool-call-parser` when `--enable-auto-tool-choice` is on.
    The rules and messages are vLLM's."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and tools is None:
        raise InputError("When using `tool_choice`, `tools` must be set.")
    if choice == "none" or not tools:
        return None
    specs = template_tools(tools)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        tool = next((t for t in specs if t["function"]["name"] == name), None)
        if tool is None:
            raise InputError(f"Tool '{name}' has not been passed in `tools`.")
        return ToolPlan(NamedParser(specs, name), OutputConstraint("json_schema", json.dumps(named_schema(tool))))
    if choice == "required":
        many = parallel is not False
        schema = json.dumps(required_schema(specs, many))
        return ToolPlan(RequiredParser(specs, many), OutputConstraint("json_schema", schema))
    if auto_parser is None:
        raise InputError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    return ToolPlan(PARSERS[auto_parser](specs))
