"""Ray Serve: an OpenAI-compatible ingress in front of replicas that each wrap an Engine, adapters multiplexed.

The ingress reads `model` from the body and calls the engine deployment with `multiplexed_model_id` = the adapter,
so Serve's router sends the request to a replica that already holds it (or, if none does, to one with the fewest).
Each engine replica loads adapters from `adapter_root/<name>/` on first use, keeps at most `max_adapters_per_replica`
(LRU, `serve.multiplexed`) and unloads an evicted one from its Engine once the requests using it are done. The
replica answers through its Engine's own HTTP app on a private Unix socket, so the OpenAI routes, validation and
status codes are the server's, said once.

    from loraplex.frontend.entrypoints.ray_serve import build_app
    serve.run(build_app({"model_path": "/models/llama", "max_lora_rank": 16}, "/adapters", num_replicas=4))
"""

# No `from __future__ import annotations`: FastAPI reads the route methods' annotations as types, and Serve's
# ingress re-creates those methods where string annotations would not resolve.
import asyncio
import json
import os
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from loraplex.frontend.entrypoints.http_utils import error_body
from loraplex.frontend.responses import ModelCard
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.errors import http_status
from ray import serve
from ray.serve.handle import DeploymentHandle

REPLICA_HEADER = "x-loraplex-replica"  # which engine replica answered (routing is checked by it)
FORWARDED_HEADERS = ("authorization", "x-api-key")  # the replica's app checks the server's own keys
MODEL_NOT_FOUND = 404


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
        self._socket_dir = tempfile.mkdtemp(prefix="loraplex-ray-")
        self._socket = os.path.join(self._socket_dir, "http.sock")
        self.engine.serve_unix_socket(self._socket)
        self._session: aiohttp.ClientSession | None = None
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

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self._socket))
        return self._session

    async def openai(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> AsyncIterator[Any]:
        """Streams a head {status, content_type, replica}, then the body's bytes as the replica's app sends them."""
        name = serve.get_multiplexed_model_id()
        if name:
            try:
                await self.adapter(name)
            except AdapterRefused as e:
                yield {"status": e.status, "content_type": "application/json", "replica": self.replica_id}
                yield msgspec.json.encode(error_body(str(e), e.status))
                return
            self._in_use[name] = self._in_use.get(name, 0) + 1  # no await since the lookup: no eviction slipped in
        try:
            async with self._client().request(method, "http://replica" + path, data=body, headers=headers) as resp:
                yield {"status": resp.status, "content_type": resp.content_type, "replica": self.replica_id}
                async for chunk in resp.content.iter_any():
                    yield chunk
        finally:
            if name:
                await self._let_go(name)

    async def models(self) -> list[dict]:
        """The base card, then one per adapter under the root (any of them is served on first use)."""
        async with self._client().get("http://replica/v1/models") as resp:
            cards = [(await resp.json())["data"][0]]
        created = int(time.time())
        for name in sorted(os.listdir(self.adapter_root)):
            path = os.path.join(self.adapter_root, name)
            if os.path.isfile(os.path.join(path, "adapter_config.json")):
                card = ModelCard(
                    id=name, object="model", created=created, owned_by="loraplex", root=path, parent=self.base
                )
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
        if self._session is not None:
            await self._session.close()
        self.engine.shutdown()
        for name in os.listdir(self._socket_dir):
            os.unlink(os.path.join(self._socket_dir, name))
        os.rmdir(self._socket_dir)


api = FastAPI(title="loraplex on Ray Serve")


@serve.deployment
@serve.ingress(api)
class OpenAIIngress:
    """/v1/completions, /v1/chat/completions and /v1/models; the body's `model` picks the multiplexed adapter."""

    def __init__(self, engine: DeploymentHandle, base_model: str):
        self.engine = engine
        self.base = base_model

    async def _forward(self, request: Request) -> Response:
        body = await request.body()
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            model = None  # the replica's app answers the malformed body with its own 400
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        headers["content-type"] = "application/json"
        handle = self.engine.options(stream=True, multiplexed_model_id=adapter_of(model, self.base))
        chunks = handle.openai.remote(request.method, request.url.path, body, headers)
        head = await chunks.__anext__()
        return StreamingResponse(
            chunks,
            status_code=head["status"],
            media_type=head["content_type"],
            headers={REPLICA_HEADER: head["replica"]},
        )

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward(request)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._forward(request)

    @api.get("/v1/models")
    async def models(self) -> Response:
        return JSONResponse({"object": "list", "data": await self.engine.models.remote()})


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
