"""GET /openapi.json: an OpenAPI 3.1 document of every route, its schemas generated from the routes' Structs."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import msgspec
from aiohttp import web
from loraplex.frontend import bodies as r
from loraplex.frontend.entrypoints.http_utils import json_response
from loraplex.frontend.openai.pooling_schemas import (
    ClassifyRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from loraplex.frontend.openai.responses_schemas import STREAM_EVENTS, ResponseObject
from loraplex.frontend.openai.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeBody,
    ResponsesRequest,
    TokenizeBody,
    VllmLoadBody,
    VllmUnloadBody,
)
from loraplex.frontend.params import AbortBody, LoadBody, NativeGenerateRequest, UnloadBody

routes = web.RouteTableDef()

SSE = "text/event-stream"  # `data: {json}` events, then `data: [DONE]`; its entry names the events' types
TEXT = "text/plain"

# Failures every route can answer (the key check, the server starting or failing); POST routes add the body's.
GET_ERRORS = {401: "missing or invalid API key", 503: "the server is starting, shutting down or has failed"}
POST_ERRORS = {
    400: "malformed, invalid, conflicting or unsupported input",
    413: "the request body is over the size limit",
    **GET_ERRORS,
}
# The generation routes add structured output's refusal where it cannot be served.
GENERATE_ERRORS = {**POST_ERRORS, 501: "a structured-output constraint on a server where xgrammar cannot be imported"}


# The pooling runner's routes (frontend/entrypoints/pooling_api.py; a generate server answers them 400)
POOLING_ROUTES = [
    ("/v1/embeddings", "OpenAI embeddings: a vector per input (pooling runner, task embed)", EmbeddingRequest),
    ("/pooling", "vLLM's pooling: the pooler's output per input (an embedding, or class probabilities)",
     EmbeddingRequest),
    ("/classify", "vLLM's classify: class probabilities and the label per input", ClassifyRequest),
    ("/score", "vLLM's score: a score per (text_1, text_2) pair", ScoreRequest),
    ("/v1/score", "As /score", ScoreRequest),
    ("/rerank", "vLLM's and Jina's rerank: the documents by relevance to the query", RerankRequest),
    ("/v1/rerank", "As /rerank", RerankRequest),
    ("/v2/rerank", "Cohere's rerank (v2): as /rerank", RerankRequest),
]

ADAPTER_FAILURE = (r.AdapterReply, r.ErrorResponse)  # what failed, per adapter; or the input was refused


class Route(NamedTuple):
    method: str
    path: str
    summary: str
    request: Any  # a Struct type, or None for no body
    ok: dict[str, Any]  # content type -> the 200 body's type (None: a plain string; SSE: a tuple of event types)
    errors: dict[int, str]  # status -> when
    error_types: dict[int, tuple] = {}  # status -> the types its body may have, where it is not ErrorResponse
    path_params: tuple[str, ...] = ()  # the `{name}` parts of path, each a string


ROUTES = [
    Route("post", "/generate", "Generate (SGLang's API); a batch for list input; SSE with stream: true",
          NativeGenerateRequest,
          {"application/json": r.GenerateResponse | list[r.GenerateResponse], SSE: (r.GenerateChunk, r.ErrorResponse)},
          GENERATE_ERRORS),
    Route("post", "/abort_request", "Abort a request by rid (200 whether or not it was in flight)",
          AbortBody, {"application/json": r.AbortResponse}, POST_ERRORS),
    Route("post", "/load_lora_adapter", "Load one adapter, or a batch with `adapters`",
          LoadBody, {"application/json": r.AdapterReply},
          {**POST_ERRORS, 400: "bad input, or an adapter that did not load", 403: "updates off"},
          {400: ADAPTER_FAILURE}),
    Route("post", "/unload_lora_adapter", "Unload one adapter, or a batch with `lora_names`",
          UnloadBody, {"application/json": r.AdapterReply},
          {**POST_ERRORS, 400: "bad input, or an adapter that did not unload", 403: "updates off",
           409: "the adapter's requests outlasted the drain timeout"},
          {400: ADAPTER_FAILURE}),
    Route("get", "/lora_adapters", "Loaded adapters", None, {"application/json": r.AdapterTable}, GET_ERRORS),
    Route("get", "/audit_log", "The last adapter operations and refusals, as --audit-log writes them (the admin "
          "key's route)", None, {"application/json": r.AuditLogResponse}, GET_ERRORS),
    Route("get", "/health", "200 when every process is alive and start-up adapters are loaded",
          None, {"application/json": r.HealthResponse}, {503: "starting, shutting down or failed"},
          {503: (r.HealthResponse,)}),
    Route("get", "/server_info", "Configuration and live counters", None,
          {"application/json": r.ServerInfoResponse}, GET_ERRORS),
    Route("get", "/get_model_info", "The base model", None, {"application/json": r.ModelInfoResponse}, GET_ERRORS),
    Route("get", "/metrics", "Prometheus metrics", None, {TEXT: None}, GET_ERRORS),
    Route("post", "/v1/completions", "OpenAI completions; SSE with stream: true", CompletionRequest,
          {"application/json": r.CompletionResponse, SSE: (r.CompletionChunk, r.ErrorResponse)},
          {**GENERATE_ERRORS, 404: "unknown model"}),
    Route("post", "/v1/chat/completions", "OpenAI chat completions; SSE with stream: true", ChatRequest,
          {"application/json": r.ChatCompletionResponse, SSE: (r.ChatCompletionChunk, r.ErrorResponse)},
          {**GENERATE_ERRORS, 404: "unknown model"}),
    Route("post", "/v1/responses", "OpenAI Responses (text and function tools, store false); with stream: true, SSE "
          "named by type (`event:` lines) and no [DONE]", ResponsesRequest,
          {"application/json": ResponseObject, SSE: STREAM_EVENTS}, {**GENERATE_ERRORS, 404: "unknown model"}),
    Route("get", "/v1/models", "The base model, then one card per adapter", None,
          {"application/json": r.ModelList}, GET_ERRORS),
    Route("get", "/v1/models/{model}", "One model's card, as in /v1/models: the base model or an adapter", None,
          {"application/json": r.ModelCard}, {**GET_ERRORS, 404: "unknown model"}, path_params=("model",)),
    Route("post", "/v1/load_lora_adapter", "Load an adapter (vLLM's API)", VllmLoadBody, {TEXT: None},
          {**POST_ERRORS, 403: "updates off", 404: "path not found", 409: "busy"}),
    Route("post", "/v1/unload_lora_adapter", "Unload an adapter (vLLM's API)", VllmUnloadBody, {TEXT: None},
          {**POST_ERRORS, 403: "updates off", 404: "unknown adapter", 409: "the drain timeout passed"}),
    Route("post", "/tokenize", "The tokens a generate route would use: `prompt` as /v1/completions, `messages` as "
          "/v1/chat/completions", TokenizeBody, {"application/json": r.TokenizeResponse},
          {**POST_ERRORS, 404: "unknown model"}),
    Route("post", "/detokenize", "Token ids back to text", DetokenizeBody, {"application/json": r.DetokenizeResponse},
          {**POST_ERRORS, 404: "unknown model"}),
    Route("get", "/tokenizer_info", "The base model's tokenizer: its class, settings, special tokens and chat "
          "template (vLLM's route)", None, {"application/json": r.TokenizerInfoResponse}, GET_ERRORS),
    Route("get", "/version", "The server's version", None, {"application/json": r.VersionResponse}, GET_ERRORS),
    Route("get", "/ping", "As /health (vLLM's name); no key needed", None, {"application/json": r.HealthResponse},
          {503: "starting, shutting down or failed"}, {503: (r.HealthResponse,)}),
    Route("get", "/health_generate", "200 once one token went through the whole pipeline, else 503", None,
          {"application/json": r.HealthResponse}, {**GET_ERRORS, 503: "starting, shutting down, failed, or the "
                                                   "generation failed"}, {503: (r.HealthResponse,)}),
    Route("get", "/openapi.json", "This document", None, {"application/json": dict[str, Any]}, GET_ERRORS),
    *[Route("post", path, summary, body, {"application/json": dict[str, Any]}, {**POST_ERRORS, 404: "unknown model"})
      for path, summary, body in POOLING_ROUTES],
]
OPEN_ROUTES = {"/health", "/ping"}  # no API key


@functools.cache
def openapi_document() -> dict:
    types = [r.ErrorResponse]
    for route in ROUTES:
        types += [route.request] if route.request is not None else []
        for t in route.ok.values():
            types += list(t) if isinstance(t, tuple) else [t] if t is not None else []
        types += [t for alternatives in route.error_types.values() for t in alternatives]
    schemas, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    schema_of = {id(t): s for t, s in zip(types, schemas, strict=True)}

    def one_of(alternatives: tuple) -> dict:
        schemas = [schema_of[id(t)] for t in alternatives]
        return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}

    def content(content_type: str, t: Any) -> dict:
        if t is None:
            return {content_type: {"schema": {"type": "string"}}}
        if content_type == SSE:  # the schema of one event (OpenAPI 3.1; 3.2 would call it itemSchema)
            data = {"type": "string", "contentMediaType": "application/json", "contentSchema": one_of(t)}
            event = {"type": "object", "required": ["data"],
                     "properties": {"data": {"anyOf": [{"const": "[DONE]"}, data]}}}
            return {SSE: {"schema": event}}
        return {content_type: {"schema": one_of(t if isinstance(t, tuple) else (t,))}}

    paths: dict[str, dict] = {}
    for route in ROUTES:
        ok = {}
        for content_type, t in route.ok.items():
            ok.update(content(content_type, t))
        answers = {"200": {"description": "OK", "content": ok}}
        for status, when in sorted(route.errors.items()):
            alternatives = route.error_types.get(status, (r.ErrorResponse,))
            answers[str(status)] = {"description": when, "content": content("application/json", alternatives)}
        operation_id = route.method + route.path.replace("/", "_").replace("{", "").replace("}", "")
        op: dict[str, Any] = {"summary": route.summary, "operationId": operation_id, "responses": answers}
        if route.path_params:
            op["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                                for name in route.path_params]
        if route.request is not None:
            op["requestBody"] = {"required": True, "content": content("application/json", route.request)}
        if route.path in OPEN_ROUTES:
            op["security"] = []
        paths.setdefault(route.path, {})[route.method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "loraplex", "version": "0.1.0",
                 "description": "Serve many LoRA adapters on one base model; SGLang- and vLLM-compatible APIs."},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "--api-key (--admin-api-key for adapter load/unload)"}},
        },
        "security": [{"bearer": []}],
    }


@routes.get("/openapi.json")
async def openapi_json(request: web.Request) -> web.Response:
    return json_response(openapi_document())
