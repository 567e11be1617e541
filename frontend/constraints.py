"""Structured-output fields of both APIs -> one OutputConstraint, checked before the request is admitted.

Native (SGLang): sampling_params `json_schema` (JSON text), `regex`, `ebnf`, `structural_tag` (JSON text). OpenAI
(vLLM): `structured_outputs` {json, regex, choice, grammar, json_object, structural_tag}, `response_format`
json_object / json_schema / structural_tag, and the older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. At most one per request.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec
from loraplex.frontend.errors import InputError
from loraplex.frontend.params import Strict
from loraplex.protocol.structs import OutputConstraint

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object


class JsonSchemaFormat(Strict, kw_only=True):
    name: str
    description: str | None = None
    schema: dict | None = None
    strict: bool | None = None  # the schema is always enforced in full


class TagStructure(Strict, kw_only=True, omit_defaults=True):  # unset: not passed on to xgrammar
    """One of a structural_tag's older `structures`: text from `begin` to `end`, the JSON between them following
    `schema`."""

    begin: str
    schema: dict | None = None
    end: str


class ResponseFormat(Strict, kw_only=True):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag, as vLLM takes it: xgrammar's `format`, or the older `structures` with `triggers`
    format: dict | None = None
    structures: list[TagStructure] | None = None
    triggers: list[str] | None = None


class StructuredOutputs(Strict, kw_only=True):
    """vLLM's structured_outputs (>= 0.12), one constraint of: json (a schema, as an object or JSON text), regex,
    choice, grammar (xgrammar EBNF), json_object, structural_tag (JSON text)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


class Found(msgspec.Struct, frozen=True):
    """A constraint and the field that gave it (error messages name the field)."""

    constraint: OutputConstraint
    field: str


def one_of(found: list[Found]) -> Found | None:
    if len(found) > 1:
        fields = ", ".join(f.field for f in found)
        raise InputError(f"at most one structured-output constraint per request, got {fields}")
    return found[0] if found else None


def native_constraint(params: Any) -> Found | None:
    """From NativeSamplingParams (or None)."""
    if params is None:
        return None
    found = [
        Found(OutputConstraint(kind, source), kind)
        for kind, source in (("json_schema", params.json_schema), ("regex", params.regex), ("ebnf", params.ebnf),
                             ("structural_tag", params.structural_tag))  # fmt: skip
        if source is not None
    ]
    return one_of(found)


def openai_constraint(req: Any) -> Found | None:
    """From an OpenAI CommonParams body."""
    found = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(Found(OutputConstraint("json_schema", JSON_OBJECT_SCHEMA), "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise InputError("response_format of type json_schema needs json_schema.schema")
        source = json.dumps(fmt.json_schema.schema)
        found.append(Found(OutputConstraint("json_schema", source), "response_format.json_schema.schema"))
    elif fmt is not None and fmt.type == "structural_tag":
        found.append(Found(OutputConstraint("structural_tag", structural_tag_source(fmt)), "response_format"))
    so = req.structured_outputs
    if so is not None and so.json_object:
        found.append(Found(OutputConstraint("json_schema", JSON_OBJECT_SCHEMA), "structured_outputs.json_object"))
    found += fields_found(so, "structured_outputs.", "json", "regex", "choice", "grammar", "structural_tag")
    found += fields_found(req, "guided_", "json", "regex", "choice", "grammar")
    return one_of(found)


def fields_found(holder: Any, prefix: str, *kinds: str) -> list[Found]:
    """The constraints set among a holder's fields of these kinds (named prefix + kind, or kind with "guided_")."""
    if holder is None:
        return []
    found = []
    for kind in kinds:
        field = prefix + kind
        value = getattr(holder, field if prefix == "guided_" else kind)
        if value is None:
            continue
        if kind == "json":
            constraint = OutputConstraint("json_schema", value if isinstance(value, str) else json.dumps(value))
        elif kind == "choice":
            constraint = OutputConstraint("ebnf", choice_grammar(value, field))
        else:
            constraint = OutputConstraint({"grammar": "ebnf"}.get(kind, kind), value)
        found.append(Found(constraint, field))
    return found


def structural_tag_source(fmt: ResponseFormat) -> str:
    """A response_format of type structural_tag as xgrammar's JSON text: its `format`, or `structures` + `triggers`."""
    if fmt.format is not None:
        if fmt.structures is not None or fmt.triggers is not None:
            raise InputError("response_format structural_tag takes `format`, or `structures` with `triggers`")
        return json.dumps({"type": "structural_tag", "format": fmt.format})
    if fmt.structures is None or fmt.triggers is None:
        raise InputError("response_format structural_tag needs `format`, or `structures` with `triggers`")
    structures = msgspec.to_builtins(fmt.structures)
    return json.dumps({"type": "structural_tag", "structures": structures, "triggers": fmt.triggers})


def choice_grammar(choices: list[str], field: str) -> str:
    """An EBNF grammar whose sentences are exactly the choices (JSON string escapes are EBNF's too)."""
    if not choices:
        raise InputError(f"{field} is an empty list")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)
