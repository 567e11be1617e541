"""The aiohttp application: routes, API keys, and the mapping of every failure to a status and a message."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web
from loraplex.frontend.caller import set_caller_key
from loraplex.frontend.entrypoints import (
    console_api,
    native_api,
    openai_api,
    openapi,
    pooling_api,
    responses_api,
    utility_api,
)
from loraplex.frontend.entrypoints.http_utils import caller_of, error_response
from loraplex.frontend.entrypoints.wire import failure, key_matches
from loraplex.frontend.errors import RateLimited
from loraplex.frontend.generate import GenerateService
from loraplex.frontend.runtime import Runtime

logger = logging.getLogger("loraplex.http")

ADAPTER_PATHS = {"/load_lora_adapter", "/unload_lora_adapter", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
ADMIN_PATHS = ADAPTER_PATHS | {"/audit_log"}  # --admin-api-key guards these (else --api-key)
OPEN_PATHS = {"/health", "/ping"}
# After the drain, how long aiohttp waits for handlers still running (adapter calls) before it cancels them.
HANDLER_SHUTDOWN_S = 3.0


def _authorized(request: web.Request, key: str) -> bool:
    return key_matches(request.headers.get("Authorization", ""), request.headers.get("X-API-Key", ""), key)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    config = request.app["runtime"].config
    if request.path in OPEN_PATHS or console_api.is_console_path(request.path):
        return await handler(request)
    key = config.admin_api_key if request.path in ADMIN_PATHS and config.admin_api_key else config.api_key
    if key is not None and not _authorized(request, key):
        if request.path in ADAPTER_PATHS:  # a refused adapter operation: its body is not read, so no names
            op = "unload" if "unload" in request.path else "load"
            request.app["runtime"].audit.record(op, [], [], caller_of(request), "unauthorized")
        return error_response("missing or invalid API key", 401)
    set_caller_key(key)
    return await handler(request)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status >= 400:
            return error_response(f"{e.reason}: {request.method} {request.path}", e.status)
        raise
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001 - the edge: a ServerError's kind picks the status, the rest is a 500
        openai = (request.path.startswith("/v1/") or request.path in utility_api.VLLM_STATUS_PATHS
                  or request.path in pooling_api.VLLM_PATHS)
        response = error_response(*failure(e, openai, f"{request.method} {request.path}"))
        if isinstance(e, RateLimited):
            response.headers["Retry-After"] = str(e.retry_after_s)
        return response


def create_app(runtime: Runtime) -> web.Application:
    app = web.Application(middlewares=[error_middleware, auth_middleware], client_max_size=64 * 2**20)
    app["runtime"] = runtime
    app["generate"] = GenerateService(runtime)
    app.add_routes(native_api.routes)
    app.add_routes(openai_api.routes)
    app.add_routes(pooling_api.routes)
    app.add_routes(responses_api.routes)
    app.add_routes(utility_api.routes)
    app.add_routes(openapi.routes)
    app.add_routes(console_api.routes)
    return app


async def serve(runtime: Runtime) -> None:
    """Start the processes, serve HTTP (and RPC) until SIGINT/SIGTERM, drain, then stop everything.

    A child that dies meanwhile makes the Runtime stop the others and answer 503; this keeps serving those 503s
    until the signal (no partial serving, no exit the orchestrator did not ask for)."""
    config = runtime.config
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    app = create_app(runtime)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=HANDLER_SHUTDOWN_S)
    rpc = None
    try:
        # HTTP first, so /health answers 503 while the processes start.
        await runner.setup()
        await web.TCPSite(runner, config.host, config.port).start()
        logger.info("listening on http://%s:%d, starting processes", config.host, config.port)
        start = asyncio.create_task(runtime.start())
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({start, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():
            start.cancel()
            return
        waiter.cancel()
        start.result()
        if config.rpc_addr:
            from loraplex.frontend.entrypoints.rpc_server import RpcServer

            rpc = RpcServer(app["generate"], config.rpc_addr)
            rpc.start()
        logger.info("serving %s on http://%s:%d", config.model_name, config.host, config.port)
        await stop.wait()
        # HTTP (and RPC) keep listening while the requests in flight finish: new ones get a 503, not a refused
        # connection, and /health says why.
        logger.info("shutting down: draining for up to %.0f s", config.shutdown_timeout)
        await runtime.drain(config.shutdown_timeout)
    finally:
        if rpc is not None:
            rpc.stop()
        await runner.cleanup()
        await runtime.shutdown()
