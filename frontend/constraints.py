"""Structured-output fields of both APIs -> one OutputConstraint, checked before the request is admitted.

Native (SGLang): sampling_params `json_schema` (JSON text), `regex`, `ebnf`. OpenAI (vLLM): `response_format`
json_object / json_schema, `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. At most one per request.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec
from loraplex.frontend.errors import InputError
from loraplex.frontend.runtime import Runtime
from loraplex.protocol.structs import OutputConstraint, SamplingParams

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    description: str | None = None
    schema: dict | None = None
    strict: bool | None = None  # the schema is always enforced in full


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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
        for kind, source in (("json_schema", params.json_schema), ("regex", params.regex), ("ebnf", params.ebnf))
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
    if req.guided_json is not None:
        source = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        found.append(Found(OutputConstraint("json_schema", source), "guided_json"))
    if req.guided_regex is not None:
        found.append(Found(OutputConstraint("regex", req.guided_regex), "guided_regex"))
    if req.guided_choice is not None:
        found.append(Found(OutputConstraint("ebnf", choice_grammar(req.guided_choice)), "guided_choice"))
    if req.guided_grammar is not None:
        found.append(Found(OutputConstraint("ebnf", req.guided_grammar), "guided_grammar"))
    return one_of(found)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly the choices (JSON string escapes are EBNF's too)."""
    if not choices:
        raise InputError("guided_choice is an empty list")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


async def constrain(runtime: Runtime, samplings: list[SamplingParams], found: Found | None) -> list[SamplingParams]:
    """The samplings with the constraint attached, once it compiles (else an InputError-like 400 naming it)."""
    if found is None:
        return samplings
    if any(not s.stop_token_ids for s in samplings):
        raise InputError(f"{found.field} needs a stop token to end the text: ignore_eos without stop_token_ids")
    await runtime.grammars.check(found.constraint, found.field, runtime.tokenizer, runtime.ready.vocab_size)
    return [msgspec.structs.replace(s, constraint=found.constraint) for s in samplings]
