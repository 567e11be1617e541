"""Every object of an OpenAI request body is strict: a field its schema does not name is a 400 naming the field's JSON
path. One body per route holds an instance of every object type its schema reaches; the test puts an unknown field in
each object of it, and a walk of the schemas' types checks that no object type is left out and that the only objects
typed `dict` (taken as they come) are the free-form ones."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from loraplex.frontend.errors import InputError
from loraplex.frontend.openai.responses import input_items
from loraplex.frontend.openai.schemas import (
    INPUT_ITEMS,
    ChatRequest,
    CompletionRequest,
    DetokenizeBody,
    ResponsesRequest,
    TokenizeBody,
    VllmLoadBody,
    VllmUnloadBody,
    decode_openai,
    strip_responses,
)
from loraplex.frontend.params import AbortBody, LoadBody, NativeGenerateRequest, Strict, UnloadBody, decode_body
from msgspec import inspect

COMMON = {
    "model": "m",
    "stream_options": {"include_usage": True},
    "response_format": {"type": "structural_tag", "json_schema": {"name": "x", "schema": {"type": "object"}},
                        "format": {"type": "const_string", "value": "a"},
                        "structures": [{"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}]},
    "structured_outputs": {"json": {"type": "object"}},
    "logit_bias": {"5": 1.0},
    "guided_json": {"type": "object"},
    "lora_mix": {"adapters": {"a": 0.7, "b": 0.3}, "merge": "ties", "density": 0.5, "seed": 1},
}
CHAT = {
    **COMMON,
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "chat_template_kwargs": {"enable_thinking": False},
}
COMPLETION = {**COMMON, "prompt": "Hi"}
RESPONSES = {
    "model": "m",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
    ],
    "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
    "tool_choice": {"type": "function", "name": "get_weather"},
    "structured_outputs": {"json": {"type": "object"}},
}

# Objects taken as they come: JSON schemas, template variables, token id -> bias, xgrammar's structural-tag format, a
# call's arguments as an object, an earlier answer's annotations and logprobs (sent back, not read), and a mix's
# adapter name -> weight.
FREE_FORM = {"schema", "parameters", "chat_template_kwargs", "logit_bias", "guided_json", "json", "format", "arguments",
             "annotations", "logprobs", "adapters"}


def decode_responses(body: bytes) -> list:
    req = decode_body(body, ResponsesRequest, strip_responses)
    return [req, *input_items(req.input)]


ROUTES = {
    "chat": (CHAT, lambda body: [decode_openai(body, ChatRequest)], [ChatRequest]),
    "completion": (COMPLETION, lambda body: [decode_openai(body, CompletionRequest)], [CompletionRequest]),
    # input items are checked one by one against their type's schema (openai/responses.py input_items)
    "responses": (RESPONSES, decode_responses, [ResponsesRequest, *INPUT_ITEMS.values()]),
}


def json_objects(value: Any, path: str = "") -> Iterator[tuple[str, dict]]:
    """(path, object) for every JSON object in value but free-form ones, paths as the messages write them."""
    if isinstance(value, dict):
        yield path, value
        for key, item in value.items():
            if key not in FREE_FORM:
                yield from json_objects(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from json_objects(item, f"{path}[{i}]")


def struct_instances(value: Any) -> Iterator[msgspec.Struct]:
    if isinstance(value, msgspec.Struct):
        yield value
        for field in value.__struct_fields__:
            yield from struct_instances(getattr(value, field))
    elif isinstance(value, list):
        for item in value:
            yield from struct_instances(item)


def walk_types(t: inspect.Type, field: str, structs: dict[type, inspect.StructType], dicts: set[str]) -> None:
    """The struct types t reaches, and the names of the fields whose value may be an object of any shape."""
    if isinstance(t, inspect.StructType):
        if t.cls in structs:
            return
        structs[t.cls] = t
        for f in t.fields:
            walk_types(f.type, f.encode_name, structs, dicts)
    elif isinstance(t, inspect.UnionType):
        for member in t.types:
            walk_types(member, field, structs, dicts)
    elif isinstance(t, (inspect.ListType, inspect.Metadata)):
        walk_types(t.item_type if isinstance(t, inspect.ListType) else t.type, field, structs, dicts)
    elif isinstance(t, (inspect.DictType, inspect.AnyType)):
        dicts.add(field)


@pytest.mark.parametrize("route", ROUTES)
def test_every_object_type_is_strict_and_in_the_sample_body(route):
    body, decode, roots = ROUTES[route]
    structs: dict[type, inspect.StructType] = {}
    dicts: set[str] = set()
    for root in roots:
        walk_types(inspect.type_info(root), "", structs, dicts)
    assert all(issubclass(cls, Strict) for cls in structs), [c.__name__ for c in structs if not issubclass(c, Strict)]
    # a `dict` that is not free-form would take any field: its shape belongs in a Strict struct
    assert dicts - {"input"} <= FREE_FORM, dicts - FREE_FORM  # responses' input: each item checked by input_items
    decoded = {type(s) for s in struct_instances(decode(json.dumps(body).encode()))}
    assert set(structs) <= decoded, set(structs) - decoded


@pytest.mark.parametrize("route", ROUTES)
def test_an_unknown_field_in_any_object_is_refused_naming_its_path(route):
    body, decode, _ = ROUTES[route]
    paths = [path for path, _ in json_objects(body)]
    assert "messages[1].tool_calls[0].function" in paths or route != "chat"
    for path in paths:
        bad = copy.deepcopy(body)
        target = dict(json_objects(bad))[path]
        target["flavour"] = 1
        with pytest.raises(InputError) as refused:
            decode(json.dumps(bad).encode())
        expected = "unknown parameter 'flavour'" if path == "" else f"unknown field '{path}.flavour'"
        assert str(refused.value) == expected


OTHER_BODIES = [NativeGenerateRequest, TokenizeBody, DetokenizeBody, AbortBody, LoadBody, UnloadBody, VllmLoadBody,
                VllmUnloadBody]


@pytest.mark.parametrize("schema", OTHER_BODIES, ids=lambda s: s.__name__)
def test_every_other_route_body_is_strict_to_its_leaves(schema):
    structs: dict[type, inspect.StructType] = {}
    dicts: set[str] = set()
    walk_types(inspect.type_info(schema), "", structs, dicts)
    assert all(issubclass(cls, Strict) for cls in structs), [c.__name__ for c in structs if not issubclass(c, Strict)]
    assert dicts <= FREE_FORM, dicts - FREE_FORM
    with pytest.raises(InputError, match=r"^unknown field 'flavour'$"):
        decode_body(b'{"flavour": 1}', schema)
