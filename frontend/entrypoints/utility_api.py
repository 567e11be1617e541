"""vLLM's and SGLang's utility routes: /tokenize, /detokenize, /tokenizer_info, /version, /ping, /health_generate."""

from __future__ import annotations

import asyncio
import logging
from importlib import metadata
from typing import Any

from aiohttp import web
from loraplex.frontend.bodies import DetokenizeResponse, HealthResponse, TokenizeResponse, VersionResponse
from loraplex.frontend.entrypoints.http_utils import (
    health_response,
    json_response,
    read_request,
    runtime_of,
    service_of,
)
from loraplex.frontend.errors import InputError
from loraplex.frontend.openai.schemas import DetokenizeBody, TokenizeBody, chat_images, chat_messages, chat_options
from loraplex.frontend.params import NativeGenerateRequest, convert

logger = logging.getLogger("loraplex.http")
routes = web.RouteTableDef()

HEALTH_GENERATE_TIMEOUT_S = 20.0
# vLLM's routes outside /v1 that answer with vLLM's status codes (an unknown model: 404)
VLLM_STATUS_PATHS = frozenset({"/tokenize", "/detokenize"})


def package_version() -> str:
    try:
        return metadata.version("loraplex")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0.0.0+unknown"


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    """The tokens /v1/completions (prompt) or /v1/chat/completions (messages) would feed the model."""
    service = service_of(request)
    body = await read_request(request, TokenizeBody)
    if (body.prompt is None) == (body.messages is None):
        raise InputError("give exactly one of 'prompt' or 'messages'")
    lora_name = None  # an adapter with its own tokenizer is tokenized with it
    if body.model is not None:
        lora_name, _ = await service.resolve_model(body.model)  # an unknown model is a 404, as on the generate routes
    if body.prompt is not None:
        tokens = service.tokenize(body.prompt, lora_name)
    else:  # a chat's images expanded as its generation's prompt has them
        sources = chat_images(body.messages)
        service.check_images(len(sources), "messages")
        tokens = service.tokenize_chat(chat_messages(body.messages), chat_options(body), lora_name)
        if sources:
            tokens = (await service.prompt_images(tokens, sources, "messages")).input_ids
    return json_response(TokenizeResponse(tokens=tokens, count=len(tokens),
                                          max_model_len=service.runtime.ready.context_length))


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    service = service_of(request)
    body = await read_request(request, DetokenizeBody)
    lora_name = None
    if body.model is not None:
        lora_name, _ = await service.resolve_model(body.model)
    return json_response(DetokenizeResponse(prompt=service.detokenize_checked(body.tokens, lora_name)))


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    """vLLM's /tokenizer_info (responses.TokenizerInfoResponse): what lm-eval's remote tokenizer and others read
    instead of loading the tokenizer themselves. The base model's; adapters do not change it."""
    settings = getattr(tokenizer, "init_kwargs", None) or {}
    info = {key: plain_json(value) for key, value in settings.items() if not key.endswith("_file")}  # server paths
    info["tokenizer_class"] = type(tokenizer).__name__
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):  # set here even where the config lacks them
        info[name] = getattr(tokenizer, name, None)
    info["model_max_length"] = tokenizer.model_max_length
    info["chat_template"] = plain_json(chat_template or getattr(tokenizer, "chat_template", None))
    return info


def plain_json(value: Any) -> Any:
    """A tokenizer setting as JSON: an AddedToken as its text, mappings with string keys, any other object as its
    str()."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, dict):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [plain_json(v) for v in value]
    content = getattr(value, "content", None)  # tokenizers' AddedToken
    return content if isinstance(content, str) else str(value)


@routes.get("/tokenizer_info")
async def get_tokenizer_info(request: web.Request) -> web.Response:
    service = service_of(request)
    return json_response(tokenizer_info(service.tokenizer(), service.runtime.chat_template))


@routes.get("/version")
async def version(request: web.Request) -> web.Response:
    return json_response(VersionResponse(version=package_version()))


@routes.get("/ping")
async def ping(request: web.Request) -> web.Response:
    """/health under vLLM's (and SageMaker's) name: no key needed."""
    return health_response(runtime_of(request))


@routes.get("/health_generate")
async def health_generate(request: web.Request) -> web.Response:
    """200 once one token went through the whole pipeline (tokenizer aside): scheduler, every rank, sampling."""
    runtime = runtime_of(request)
    if not runtime.healthy:
        return health_response(runtime)
    token_id = next((t for t in (runtime.tokenizer.bos_token_id, runtime.tokenizer.eos_token_id) if t is not None), 0)
    body = convert({"input_ids": [token_id], "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
                   NativeGenerateRequest, "health check")
    service = service_of(request)
    states: list = []
    try:
        states, batched = await service.start(body)
        out = await asyncio.wait_for(service.collect(states, batched), HEALTH_GENERATE_TIMEOUT_S)
        if len(out["output_ids"]) != 1:
            raise RuntimeError(f"generated {len(out['output_ids'])} tokens, expected 1")
    except Exception as e:  # noqa: BLE001 - any failure is the answer: unhealthy
        reason = f"generation failed: {type(e).__name__}: {e}" if str(e) else f"generation failed: {type(e).__name__}"
        logger.warning("/health_generate: %s", reason)
        return json_response(HealthResponse(status="unhealthy", reason=reason), 503)
    finally:
        await service.finish(states)
    return json_response(HealthResponse(status="ok"))
