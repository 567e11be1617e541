"""Small aiohttp helpers shared by the native and OpenAI routes: JSON errors, SSE, merged streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import msgspec
from aiohttp import web
from loraplex.frontend.params import decode_body
from loraplex.frontend.request_state import RequestState
from loraplex.frontend.responses import ErrorDetail, ErrorResponse
from loraplex.frontend.runtime import Runtime

T = TypeVar("T")

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 409: "ConflictError", 413: "RequestTooLarge", 499: "ClientClosedRequest",
               500: "InternalServerError", 503: "ServiceUnavailableError", 504: "TimeoutError"}

_encoder = msgspec.json.Encoder()


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=_encoder.encode(obj), status=status, content_type="application/json")


def error_body(message: str, status: int) -> ErrorResponse:
    return ErrorResponse(ErrorDetail(message=message, type=ERROR_TYPES.get(status, "Error"), code=status))


def error_response(message: str, status: int) -> web.Response:
    return json_response(error_body(message, status), status)


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
    await resp.write(b"data: " + _encoder.encode(obj) + b"\n\n")


async def send_sse_done(resp: web.StreamResponse) -> None:
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


async def stream_many(runtime: Runtime, states: list[RequestState]) -> AsyncIterator[tuple[int, RequestState]]:
    """Yields (index, state) whenever any of the states changes, until all have finished."""
    if len(states) == 1:
        async for state in runtime.stream(states[0]):
            yield 0, state
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, state: RequestState) -> None:
        async for s in runtime.stream(state):
            # is_last is taken now: by the time the entry is read the state may have finished, and an earlier
            # entry of the same state must not count as its end (the loop would stop while others still run).
            queue.put_nowait((index, s, s.finished))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(states)]
    try:
        remaining = len(states)
        while remaining:
            index, state, is_last = await queue.get()
            yield index, state
            if is_last:
                remaining -= 1
    finally:
        for task in tasks:
            task.cancel()


async def wait_all(runtime: Runtime, states: list[RequestState]) -> None:
    async for _ in stream_many(runtime, states):
        pass
