"""/openapi.json against a live server: schemathesis over every route (no 5xx, responses match their schemas),
and bodies the JSON parser cannot take (deep nesting, huge numbers, invalid UTF-8, over-size) get a JSON 4xx."""

from __future__ import annotations

import collections

import hypothesis
import pytest
import requests
import schemathesis
from schemathesis import GenerationMode
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
               "/v1/chat/completions", "/v1/responses", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/tokenize",
               "/detokenize"]
BODY_LIMIT = 64 * 2**20  # frontend.http_server's client_max_size
SEED = 20261130
EXAMPLES_PER_MODE = 40  # per route and mode: ~1 minute in all on two slow cores
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def server(llama_dir):
    # A short context bounds what any generated request can cost.
    with ServerProcess("--model-path", str(llama_dir), "--enable-lora", "--max-lora-rank", "8",
                       "--lora-target-modules", "all", "--context-length", "256",
                       "--max-total-tokens", "2048", "--api-key", API_KEY) as srv:
        yield srv


def test_schemathesis_finds_no_server_error_or_schema_violation(server):
    # One test over every route (schemathesis's lazy pytest fixtures do not run under pytest 9): each route gets
    # schema-valid and schema-violating bodies, with a fixed seed; every failure is collected, then reported.
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=AUTH, timeout=30)
    base = server.get("/v1/models", headers=AUTH).json()["data"][0]["id"]

    @schema.hook("map_body")
    def reach_generation(context, body):
        # Random bodies almost never name a prompt and a served model, so generation would go untested. Adding what
        # is missing, or setting a string model to the served name, cannot make a schema-violating body valid.
        if not isinstance(body, dict):
            return body
        if context.operation.path == "/generate" and "text" not in body and "input_ids" not in body:
            return {**body, "text": "Hello"}
        if context.operation.path.startswith("/v1/") and isinstance(body.get("model"), str):
            return {**body, "model": base}
        return body

    failures: list[str] = []
    statuses: collections.Counter = collections.Counter()
    num_operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        num_operations += 1
        # A route without a body or parameters has no schema-violating request to make.
        has_input = operation.body or any(True for _ in operation.iter_parameters())
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_input else (GenerationMode.POSITIVE,)
        for mode in modes:

            @hypothesis.seed(SEED)
            @hypothesis.settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None,
                                 phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
                                 suppress_health_check=list(hypothesis.HealthCheck))
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode, hooks=schema.hooks))
            def run(case):
                resp = case.call_and_validate(base_url=server.url, headers=AUTH, timeout=60, checks=CHECKS)
                statuses[(case.operation.label, resp.status_code)] += 1

            try:
                run()
            except Exception as e:  # noqa: BLE001 - collected, so one run reports every route's failures
                failures.append(f"{operation.label} ({mode.value}): {e}")
    assert not failures, "\n\n".join(failures)
    assert num_operations == 31  # every route but /openapi.json itself, which schemathesis leaves out
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        assert statuses[(f"POST {path}", 200)] > 0, f"no fuzzed request reached generation on {path}"
    assert server.get("/health").status_code == 200


def test_valid_requests_succeed_with_bodies_that_match_their_schemas(server, adapter_dirs):
    # Fuzzed bodies rarely make a request that can succeed (one prompt field of two, a known model, a real adapter
    # path), so each route's successful answers, plain, batched and streamed, are checked here one by one.
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=AUTH, timeout=30)
    base = server.get("/v1/models", headers=AUTH).json()["data"][0]["id"]
    greedy = {"max_new_tokens": 4, "temperature": 0}
    steps = [
        ("POST", "/load_lora_adapter", {"lora_name": "a4", "lora_path": str(adapter_dirs["a4"])}),
        ("POST", "/load_lora_adapter", {"adapters": [{"lora_name": "a8", "lora_path": str(adapter_dirs["a8"])}]}),
        ("POST", "/generate", {"text": "Hello", "sampling_params": greedy}),
        ("POST", "/generate", {"text": ["Hello", "Hi"], "lora_path": ["a4", None], "sampling_params": greedy}),
        ("POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": {**greedy, "stop": "x"}, "stream": True}),
        ("POST", "/abort_request", {"rid": "nothing-in-flight"}),
        ("POST", "/v1/completions", {"model": "a4", "prompt": ["Hello", "Hi"], "max_tokens": 3, "n": 2}),
        ("POST", "/v1/completions", {"model": base, "prompt": "Hi", "max_tokens": 3, "stream": True,
                                     "stream_options": {"include_usage": True}}),
        ("POST", "/v1/chat/completions", {"model": f"{base}:a8", "max_tokens": 3,
                                          "messages": [{"role": "user", "content": "Hi"}]}),
        ("POST", "/v1/chat/completions", {"model": "a4", "max_tokens": 3, "stream": True,
                                          "messages": [{"role": "user", "content": "Hi"}]}),
        ("GET", "/lora_adapters", None),
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/{model}", {"model": base}),
        ("GET", "/v1/models/{model}", {"model": "a4"}),
        ("GET", "/server_info", None),
        ("GET", "/get_model_info", None),
        ("GET", "/metrics", None),
        ("GET", "/tokenizer_info", None),
        ("GET", "/health", None),
        ("POST", "/unload_lora_adapter", {"lora_names": ["a8"]}),
        ("POST", "/unload_lora_adapter", {"lora_name": "a4"}),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "a16", "lora_path": str(adapter_dirs["a8"])}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "a16"}),
        ("GET", "/audit_log", None),  # the operations above, as the console's audit panel reads them
    ]
    for method, path, body in steps:
        operation = schema[path][method]
        if "{" in path:  # the path's parameters
            case = operation.Case(path_parameters=body)
        else:
            case = operation.Case(body=body, media_type="application/json") if body is not None else operation.Case()
        resp = case.call_and_validate(base_url=server.url, headers=AUTH, timeout=60, checks=CHECKS)
        assert resp.status_code == 200, (path, body, resp.text[:300])


def test_openapi_document_lists_every_route_and_needs_the_key(server):
    assert server.get("/openapi.json").status_code == 401
    doc = server.get("/openapi.json", headers=AUTH).json()
    assert doc["openapi"].startswith("3.")
    for path in POST_ROUTES:
        op = doc["paths"][path]["post"]
        assert "requestBody" in op and "200" in op["responses"] and "413" in op["responses"], path
    for path in ("/health", "/server_info", "/lora_adapters", "/v1/models", "/v1/models/{model}", "/metrics",
                 "/openapi.json"):
        assert "200" in doc["paths"][path]["get"]["responses"], path
    assert "404" in doc["paths"]["/v1/models/{model}"]["get"]["responses"]
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
    resp = post(b'{"' + b"k" * 2**20 + b'": 1}')  # an unknown field's name is quoted, cut short
    assert resp.status_code == 400 and len(resp.content) < 1000
    assert server.get("/health").status_code == 200


@pytest.mark.parametrize("path", POST_ROUTES)
def test_over_size_body_gets_a_json_413(server, path):
    resp = requests.post(server.url + path, data=b" " * (BODY_LIMIT + 1), headers=AUTH, timeout=60)
    assert_json_error(resp, 413, "limit")


def test_huge_or_mistyped_numbers_and_nul_paths_are_refused(server):
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
        ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp/\x00a"}, "lora_path"),
        ("/load_lora_adapter", {"adapters": [{"lora_name": "a", "lora_path": "\x00"}]}, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp/\x00a"}, "lora_path"),
    ]
    for path, body, words in cases:
        assert_json_error(requests.post(server.url + path, json=body, headers=AUTH, timeout=60), 400, words)
