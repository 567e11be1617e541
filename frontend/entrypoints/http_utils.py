"""Small aiohttp helpers shared by the routes: the app's Runtime and GenerateService, JSON errors, SSE."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from aiohttp import web
from loraplex.frontend.adapters.audit import Caller
from loraplex.frontend.bodies import HealthResponse, error_body
from loraplex.frontend.entrypoints.wire import SSE_DONE, encode_json, presented_key, sse_event
from loraplex.frontend.generate import GenerateService
from loraplex.frontend.params import decode_body
from loraplex.frontend.runtime import Runtime

T = TypeVar("T")

def caller_of(request: web.Request) -> Caller:
    """Who sent an adapter operation, for the audit log: the client's address and the key it presented."""
    key = presented_key(request.headers.get("Authorization", ""), request.headers.get("X-API-Key", ""))
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else request.remote
    return Caller.presenting(client, key or None)


def runtime_of(request: web.Request) -> Runtime:
    return request.app["runtime"]


def service_of(request: web.Request) -> GenerateService:
    return request.app["generate"]


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=encode_json(obj), status=status, content_type="application/json")


def error_response(message: str, status: int) -> web.Response:
    return json_response(error_body(message, status), status)


def health_response(runtime: Runtime) -> web.Response:
    """/health and /ping: 200 while serving, else 503 and why."""
    if runtime.healthy:
        return json_response(HealthResponse(status="ok"))
    reason = runtime.failure or ("shutting down" if runtime.stopping or runtime.draining else "starting")
    return json_response(HealthResponse(status="unhealthy", reason=reason), 503)


async def read_request(request: web.Request, schema: type[T], strip: Callable[[dict], object] | None = None) -> T:
    """Every POST route's body: read (413 past client_max_size), then params.decode_body (400 for bad input)."""
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        limit = request.client_max_size
        raise web.HTTPRequestEntityTooLarge(
            max_size=limit, actual_size=request.content_length or limit + 1,
            reason=f"Request body larger than the {limit}-byte limit",
        ) from e
    return decode_body(body, schema, strip)


async def start_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def send_sse(resp: web.StreamResponse, obj: object) -> None:
    await resp.write(sse_event(obj))


async def send_sse_done(resp: web.StreamResponse) -> None:
    await resp.write(SSE_DONE)
    await resp.write_eof()
