"""POST /v1/responses (OpenAI's Responses API, vLLM's status codes): the Response object, or its events as
Server-Sent Events named by type (`event: <type>`, `data: <event>`), without a closing [DONE], as OpenAI sends them."""

from __future__ import annotations

from aiohttp import web
from loraplex.frontend.entrypoints.http_utils import error_response, json_response, read_request, service_of, start_sse
from loraplex.frontend.entrypoints.wire import named_sse_event
from loraplex.frontend.generate import GenerationFailed
from loraplex.frontend.openai.responses import start_response
from loraplex.frontend.openai.schemas import ResponsesRequest, strip_responses

routes = web.RouteTableDef()


@routes.post("/v1/responses")
async def responses(request: web.Request) -> web.StreamResponse:
    req = await read_request(request, ResponsesRequest, strip_responses)
    run = await start_response(service_of(request), req)
    try:
        if not req.stream:
            try:
                return json_response(await run.result())
            except GenerationFailed as e:
                return error_response(str(e), e.status)
        resp = await start_sse(request)
        async for event in run.events():
            await resp.write(named_sse_event(event))
        await resp.write_eof()
        return resp
    finally:
        await run.close()

