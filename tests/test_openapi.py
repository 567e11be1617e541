"""/openapi.json against a live server: schemathesis over every route (no 5xx, responses match their schemas),
and bodies the JSON parser cannot take (deep nesting, huge numbers, invalid UTF-8, over-size) get a JSON 4xx."""

from __future__ import annotations

import pytest
import requests
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server_utils import ServerProcess

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
POST_ROUTES = ["/generate", "/load_lora_adapter", "/unload_lora_adapter", "/abort_request", "/v1/completions",
               "/v1/chat/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"]
BODY_LIMIT = 64 * 2**20  # frontend.http_server's client_max_size
# Positive and negative cases, a few per route and phase, one fixed seed: ~1 minute on two slow cores.
SCHEMATHESIS_CONFIG = """
seed = 20261130
[generation]
modes = ["positive", "negative"]
max-examples = 8
[phases.examples]
enabled = true
[phases.coverage]
enabled = false
[phases.fuzzing]
enabled = true
[phases.stateful]
enabled = false
"""


@pytest.fixture(scope="module")
def server(llama_dir):
    # A short context bounds what any generated request can cost.
    with ServerProcess("--model-path", str(llama_dir), "--enable-lora", "--max-lora-rank", "8",
                       "--lora-target-modules", "all", "--context-length", "64",
                       "--max-total-tokens", "2048", "--api-key", API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server):
    config = schemathesis.Config.from_str(SCHEMATHESIS_CONFIG)
    return schemathesis.openapi.from_url(server.url + "/openapi.json", config=config, headers=AUTH, timeout=30)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
def test_schemathesis(case, server):
    case.call_and_validate(
        base_url=server.url, headers=AUTH, timeout=60,
        checks=[not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance,
                negative_data_rejection],
    )


def test_openapi_document_lists_every_route_and_needs_the_key(server):
    assert server.get("/openapi.json").status_code == 401
    doc = server.get("/openapi.json", headers=AUTH).json()
    assert doc["openapi"].startswith("3.")
    for path in POST_ROUTES:
        op = doc["paths"][path]["post"]
        assert "requestBody" in op and "200" in op["responses"] and "413" in op["responses"], path
    for path in ("/health", "/server_info", "/lora_adapters", "/v1/models", "/metrics", "/openapi.json"):
        assert "200" in doc["paths"][path]["get"]["responses"], path
    assert doc["paths"]["/health"]["get"]["security"] == []


def assert_json_error(resp: requests.Response, status: int, words: str) -> None:
    assert resp.status_code == status, resp.text[:300]
    error = resp.json()["error"]
    assert error["code"] == status and isinstance(error["type"], str)
    assert words in error["message"], error["message"]


@pytest.mark.parametrize("path", POST_ROUTES)
def test_bodies_the_parser_cannot_take_get_a_json_400(server, path):
    post = lambda body: requests.post(server.url + path, data=body, headers=AUTH, timeout=60)  # noqa: E731
    depth = 100_000
    assert_json_error(post(b"[" * depth + b"]" * depth), 400, "nested too deeply")
    assert_json_error(post(b'{"a": ' * depth + b"1" + b"}" * depth), 400, "nested too deeply")
    assert_json_error(post(b'{"x": 1e999}'), 400, "out of range")
    assert_json_error(post(b'{"x": 1' + b"0" * 5000 + b"}"), 400, "out of range")
    assert_json_error(post(b'{"x": "\xff\xfe"}'), 400, "UTF-8")
    assert_json_error(post(b'{"x": "\\ud800"}'), 400, "malformed JSON")
    assert_json_error(post(b"[1, 2]"), 400, "JSON object")
    assert_json_error(post(b"{"), 400, "malformed JSON")
    # Nested below the decoder's limit but deep enough that a careless repr or convert would overflow.
    nested = b"[" * 900 + b"]" * 900
    resp = post(b'{"logit_bias": ' + nested + b', "metadata": ' + nested + b', "return_logprob": ' + nested + b"}")
    assert resp.status_code == 400 and "error" in resp.json()
    assert server.get("/health").status_code == 200


@pytest.mark.parametrize("path", POST_ROUTES)
def test_over_size_body_gets_a_json_413(server, path):
    resp = requests.post(server.url + path, data=b" " * (BODY_LIMIT + 1), headers=AUTH, timeout=60)
    assert_json_error(resp, 413, "limit")


def test_huge_and_mistyped_numbers_are_refused(server):
    cases = [
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "4"}}, "Expected `int`"),
        ("/generate", {"text": "hi", "sampling_params": {"top_k": 2**64}}, "<= 9223372036854775807"),
        ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [2**70]}}, "<= 9223372036854775807"),
        ("/generate", {"text": "hi", "sampling_params": {"ignore_eos": 1}}, "Expected `bool`"),
        ("/generate", {"text": "hi", "stream": "true"}, "Expected `bool`"),
        ("/generate", {"input_ids": [2**70]}, "<= 9223372036854775807"),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": 1e308}}, "<= 100.0"),
        ("/v1/completions", {"model": "x", "prompt": "hi", "max_tokens": 2**80}, "<= 9223372036854775807"),
        ("/v1/completions", {"model": "x", "prompt": "hi", "seed": "1"}, "Expected `int"),
        ("/v1/completions", {"model": "x", "prompt": "hi", "n": 17}, "<= 16"),
        ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/p", "load_inplace": "false"}, "Expected `bool`"),
        ("/v1/unload_lora_adapter", {"lora_name": "a", "lora_int_id": 2**64}, "<= 9223372036854775807"),
    ]
    for path, body, words in cases:
        assert_json_error(requests.post(server.url + path, json=body, headers=AUTH, timeout=60), 400, words)
