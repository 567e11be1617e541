"""Ray Serve: an OpenAI-compatible ingress in front of replicas that each wrap an Engine, adapters multiplexed.

The ingress reads `model` from the body and calls the engine deployment with `multiplexed_model_id` = the adapter,
so Serve's router sends the request to a replica that already holds it (or, if none does, to one with the fewest).
Each engine replica loads adapters from `adapter_root/<name>/` on first use, keeps at most `max_adapters_per_replica`
(LRU, `serve.multiplexed`) and unloads an evicted one from its Engine once the requests using it are done. The
replica answers with the server's own OpenAI code (frontend/openai/) on its Engine's GenerateService, so the
validation, keys and status codes are the server's, said once.

    from loraplex.frontend.entrypoints.ray_serve import build_app
    serve.run(build_app({"model_path": "/models/llama", "max_lora_rank": 16}, "/adapters", num_replicas=4))
"""

# No `from __future__ import annotations`: FastAPI reads the route methods' annotations as types, and Serve's
# ingress re-creates those methods where string annotations would not resolve.
import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from loraplex.frontend.bodies import ModelCard, error_body
from loraplex.frontend.caller import set_caller_key
from loraplex.frontend.entrypoints.wire import SSE_DONE, encode_json, failure, key_matches, named_sse_event, sse_event
from loraplex.frontend.errors import RateLimited
from loraplex.frontend.generate import GenerateService, GenerationFailed
from loraplex.frontend.openai.responses import ResponsesRun, start_response
from loraplex.frontend.openai.schemas import (
    ChatRequest,
    CompletionRequest,
    ResponsesRequest,
    decode_openai,
    strip_responses,
)
from loraplex.frontend.openai.serving import OpenAIRun, base_card, start_chat, start_completion
from loraplex.frontend.params import decode_body
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.errors import http_status
from ray import serve
from ray.serve.handle import DeploymentHandle

REPLICA_HEADER = "x-loraplex-replica"  # which engine replica answered (routing is checked by it)
FORWARDED_HEADERS = ("authorization", "x-api-key")  # the replica checks the server's own keys
MODEL_NOT_FOUND = 404
JSON = "application/json"
# path -> (body bytes -> its request struct, the start of its run), as the aiohttp routes decode and start them
ROUTES = {
    "/v1/completions": (lambda body: decode_openai(body, CompletionRequest), start_completion),
    "/v1/chat/completions": (lambda body: decode_openai(body, ChatRequest), start_chat),
    "/v1/responses": (lambda body: decode_body(body, ResponsesRequest, strip_responses), start_response),
}


def base_model_name(engine_kwargs: dict) -> str:
    return ServerConfig.from_kwargs(**engine_kwargs).model_name


def adapter_of(model: Any, base: str) -> str:
    """The multiplexed model id of a request's `model`: "" for the base model (any replica serves it)."""
    if not isinstance(model, str) or model == base:
        return ""
    prefix, sep, name = model.partition(":")
    return name if sep and prefix == base else model


class AdapterRefused(Exception):
    """An adapter this replica could not load: the status and message the server's /v1 routes would give."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Adapter:
    """One adapter held by a replica; Serve's multiplexer calls __del__ when it evicts it (in a thread)."""

    def __init__(self, name: str, release: Any):
        self.name = name
        self._release = release
        self._released = False

    def __del__(self) -> None:
        if not self._released:
            self._released = True
            self._release(self.name)


@serve.deployment
class LoRAEngine:
    """One Engine per replica; adapters are Serve's multiplexed models."""

    def __init__(self, engine_kwargs: dict, adapter_root: str, max_adapters_per_replica: int):
        from loraplex.frontend.entrypoints.engine import Engine

        self.adapter_root = os.path.realpath(adapter_root)
        kwargs = {"enable_lora": True, "lora_path_root": self.adapter_root, **engine_kwargs}
        self.engine = Engine(**kwargs)
        self.base = self.engine.config.model_name
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_use: dict[str, int] = {}  # adapter -> requests forwarded and not finished
        self._idle = asyncio.Condition()
        self.num_loads: dict[str, int] = {}
        self._closing = False

        async def load(name: str) -> _Adapter:
            return await self._load_adapter(name)

        # Wrapped here, not at class level, so the LRU size is a constructor argument.
        self.adapter = serve.multiplexed(max_num_models_per_replica=max_adapters_per_replica)(load)

    async def _load_adapter(self, name: str) -> _Adapter:
        self._loop = asyncio.get_running_loop()
        path = os.path.join(self.adapter_root, name)
        if "/" in name or name in (".", "..") or not os.path.isdir(path):
            raise AdapterRefused(MODEL_NOT_FOUND, f"The model `{name}` does not exist.")
        out = await self.engine.async_load_lora_adapter(name, path)
        if not out.success:  # not an adapter, rank or modules beyond the pool, ...: the /v1 load route's status
            raise AdapterRefused(http_status(out.results[0].error_kind, openai=True), out.error_message)
        self.num_loads[name] = self.num_loads.get(name, 0) + 1
        return _Adapter(name, self._release)

    def _release(self, name: str) -> None:
        # Serve runs an evicted model's __del__ in a worker thread: unload on the replica's loop, once the
        # requests that hold the adapter are done (the Engine's unload then drains what it still runs).
        if self._closing or self._loop is None or self._loop.is_closed():
            return  # the Engine is gone, and its adapters with it
        asyncio.run_coroutine_threadsafe(self._unload_when_idle(name), self._loop).result()

    async def _unload_when_idle(self, name: str) -> None:
        async with self._idle:
            await self._idle.wait_for(lambda: self._in_use.get(name, 0) == 0)
        await self.engine.async_unload_lora_adapter(name)

    async def _let_go(self, name: str) -> None:
        async with self._idle:
            self._in_use[name] -= 1
            self._idle.notify_all()

    async def openai(self, path: str, body: bytes, headers: dict[str, str]) -> AsyncIterator[Any]:
        """Streams a head {status, content_type, replica}, then the body's bytes as the server would send them."""
        name = serve.get_multiplexed_model_id()
        if name:
            try:
                await self.adapter(name)
            except AdapterRefused as e:
                yield {"status": e.status, "content_type": JSON, "replica": self.replica_id}
                yield encode_json(error_body(str(e), e.status))
                return
            self._in_use[name] = self._in_use.get(name, 0) + 1  # no await since the lookup: no eviction slipped in
        try:
            async for item in self.engine.async_iterate(lambda service: answer(service, path, body, headers)):
                yield {**item, "replica": self.replica_id} if isinstance(item, dict) else item
        finally:
            if name:
                await self._let_go(name)

    async def models(self) -> list[dict]:
        """The base card, then one per adapter under the root (any of them is served on first use)."""
        cards = [msgspec.to_builtins(base_card(self.engine.runtime))]  # set at start: safe from this thread
        for name in sorted(os.listdir(self.adapter_root)):
            path = os.path.join(self.adapter_root, name)
            if os.path.isfile(os.path.join(path, "adapter_config.json")):
                card = ModelCard(id=name, object="model", created=cards[0]["created"], owned_by="loraplex", root=path,
                                 parent=self.base)
                cards.append(msgspec.to_builtins(card))
        return cards

    async def stats(self) -> dict:
        """This replica's id, the adapters its Engine holds, how often each was loaded, its child processes."""
        return {
            "replica": self.replica_id,
            "adapters": sorted(a["lora_name"] for a in self.engine.list_lora_adapters()),
            "num_loads": dict(self.num_loads),
            "pids": list(self.engine.runtime.procs.pids().values()),
        }

    async def __del__(self) -> None:
        self._closing = True
        self.engine.shutdown()


async def answer(service: GenerateService, path: str, body: bytes, headers: dict[str, str]) -> AsyncIterator[Any]:
    """One /v1 completions, chat or responses request as the server's HTTP app answers it (keys, validation,
    statuses), run on the Engine's loop: a head {status, content_type}, then the body's bytes."""
    key = service.runtime.config.api_key
    if key is not None and not key_matches(headers.get("authorization", ""), headers.get("x-api-key", ""), key):
        yield {"status": 401, "content_type": JSON}
        yield encode_json(error_body("missing or invalid API key", 401))
        return
    set_caller_key(key)
    decode, start = ROUTES[path]
    try:
        run = await start(service, decode(body))
    except Exception as e:  # noqa: BLE001 - the edge: a ServerError's kind picks the status, the rest is a 500
        message, status = failure(e, openai=True, where=f"POST {path}")
        retry = {"Retry-After": str(e.retry_after_s)} if isinstance(e, RateLimited) else {}
        yield {"status": status, "content_type": JSON, "headers": retry}
        yield encode_json(error_body(message, status))
        return
    responses = isinstance(run, ResponsesRun)
    try:
        if not run.stream:
            try:
                payload, status = await (run.result() if responses else run.response()), 200
            except GenerationFailed as e:
                payload, status = error_body(str(e), e.status), e.status
            yield {"status": status, "content_type": JSON}
            yield encode_json(payload)
            return
        yield {"status": 200, "content_type": "text/event-stream"}
        async for piece in sse_body(run):
            yield piece
    finally:
        await run.close()


async def sse_body(run: OpenAIRun | ResponsesRun) -> AsyncIterator[bytes]:
    """A stream's bytes as the aiohttp routes send them: chunks then [DONE], or Responses events named by type."""
    if isinstance(run, ResponsesRun):
        async for event in run.events():
            yield named_sse_event(event)
        return
    async for chunk in run.chunks():
        yield sse_event(chunk)
    yield SSE_DONE


api = FastAPI(title="loraplex on Ray Serve")


@serve.deployment
@serve.ingress(api)
class OpenAIIngress:
    """/v1/completions, /v1/chat/completions, /v1/responses and /v1/models; the body's `model` picks the
    multiplexed adapter."""

    def __init__(self, engine: DeploymentHandle, base_model: str):
        self.engine = engine
        self.base = base_model
        self.created = int(time.time())  # every card's `created`: the replicas started at different times

    async def _cards(self) -> list[dict]:
        return [{**card, "created": self.created} for card in await self.engine.models.remote()]

    async def _forward(self, request: Request) -> Response:
        body = await request.body()
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            model = None  # the replica answers the malformed body with the server's own 400
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        headers["content-type"] = "application/json"
        handle = self.engine.options(stream=True, multiplexed_model_id=adapter_of(model, self.base))
        chunks = handle.openai.remote(request.url.path, body, headers)
        head = await chunks.__anext__()
        return StreamingResponse(
            chunks,
            status_code=head["status"],
            media_type=head["content_type"],
            headers={REPLICA_HEADER: head["replica"], **head.get("headers", {})},
        )

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward(request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._forward(request)

    @api.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        return await self._forward(request)

    @api.get("/v1/models")
    async def models(self) -> Response:
        return JSONResponse({"object": "list", "data": await self._cards()})

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> Response:
        """One card (the `openai` client's models.retrieve), or a 404 in the server's error shape."""
        for card in await self._cards():
            if card["id"] == model_id:
                return JSONResponse(card)
        return JSONResponse(msgspec.to_builtins(error_body(f"The model `{model_id}` does not exist.", 404)),
                            status_code=404)


def build_app(
    engine_kwargs: dict,
    adapter_root: str,
    *,
    num_replicas: int = 1,
    max_adapters_per_replica: int = 8,
    ray_actor_options: dict | None = None,
    ingress_actor_options: dict | None = None,
) -> serve.Application:
    """The two deployments bound together: `serve.run(build_app(...))`. `engine_kwargs` are the Engine's (every
    launch flag as a snake_case keyword); adapters are loaded from `adapter_root/<name>/` and confined to it.
    `ray_actor_options` are the engine replicas' resources (GPUs go there), `ingress_actor_options` the ingress's."""
    engine = LoRAEngine.options(num_replicas=num_replicas, ray_actor_options=ray_actor_options or {}).bind(
        engine_kwargs, adapter_root, max_adapters_per_replica
    )
    ingress = OpenAIIngress.options(ray_actor_options=ingress_actor_options or {})
    return ingress.bind(engine, base_model_name(engine_kwargs))
