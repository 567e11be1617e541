"""Native, SGLang-compatible routes: /generate, adapters, abort, health and info."""

from __future__ import annotations

from aiohttp import web
from loraplex.frontend.bodies import (
    AbortResponse,
    AdapterReply,
    AdapterResult,
    AuditLogResponse,
    ModelInfoResponse,
)
from loraplex.frontend.entrypoints.http_utils import (
    caller_of,
    error_response,
    health_response,
    json_response,
    read_request,
    runtime_of,
    send_sse,
    send_sse_done,
    service_of,
    start_sse,
)
from loraplex.frontend.errors import InputError
from loraplex.frontend.generate import GenerationFailed
from loraplex.frontend.params import AbortBody, LoadBody, NativeGenerateRequest, UnloadBody, strip_native
from loraplex.frontend.server_info import replica_stats, server_info
from loraplex.protocol.errors import http_status
from loraplex.protocol.pooling import PoolingSpec
from loraplex.protocol.structs import (
    LoadLoRAAdapterReqOutput,
    LoRAAdapterSpec,
    UnloadLoRAAdapterReqOutput,
)

routes = web.RouteTableDef()


@routes.post("/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    service = service_of(request)
    body = await read_request(request, NativeGenerateRequest, strip_native)
    states, batched = await service.start(body)  # refuses at once (503) while the server starts or stops
    try:
        if not body.stream:
            try:
                return json_response(await service.collect(states, batched))
            except GenerationFailed as e:
                return error_response(str(e), e.status)
        resp = await start_sse(request)
        async for chunk in service.chunks(states, batched):
            await send_sse(resp, chunk)
        await send_sse_done(resp)
        return resp
    finally:
        await service.finish(states)


@routes.post("/abort_request")
async def abort_request(request: web.Request) -> web.Response:
    body = await read_request(request, AbortBody)
    out = await service_of(request).abort(body.rid)
    # 200 either way, as SGLang does: the request may have finished a moment before the abort arrived.
    return json_response(AbortResponse(success=out.success, rid=out.rid, message=out.message))


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    return health_response(runtime_of(request))


@routes.get("/server_info")
async def get_server_info(request: web.Request) -> web.Response:
    return json_response(await server_info(runtime_of(request), service_of(request).requests))


@routes.get("/get_model_info")
async def model_info(request: web.Request) -> web.Response:
    runtime = runtime_of(request)
    return json_response(ModelInfoResponse(model_path=runtime.config.model_path,
                                           served_model_name=runtime.config.model_name, is_generation=True))


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    runtime = runtime_of(request)
    replicas = await replica_stats(runtime)
    if replicas is not None:
        names = {e.lora_id: e.name for e in runtime.registry.live()}
        capacities = [r.max_total_tokens for r in runtime.replica_ready]
        runtime.metrics.update_scheduler(replicas, capacities, runtime.config.max_loras_per_batch, names)
    return web.Response(body=runtime.metrics.render(), content_type="text/plain")


# ---- adapters -----------------------------------------------------------------------------------------


def adapter_reply(out: LoadLoRAAdapterReqOutput | UnloadLoRAAdapterReqOutput, batch: bool) -> web.Response:
    """Batch forms: 200 only if every item succeeded, else 400 with per-item results; one adapter: its kind's status."""
    results = [AdapterResult(r.lora_name, r.success, r.error_message) for r in out.results] if batch else None
    reply = AdapterReply(success=out.success, error_message=out.error_message, loaded_adapters=out.loaded_adapters,
                         results=results)
    if out.success or batch:
        return json_response(reply, 200 if out.success else 400)
    return json_response(reply, http_status(out.results[0].error_kind, openai=False))


@routes.post("/load_lora_adapter")
async def load_lora_adapter(request: web.Request) -> web.Response:
    body = await read_request(request, LoadBody)
    if body.adapters is not None:
        if body.lora_name is not None or body.lora_path is not None or body.draft_lora_path is not None:
            raise InputError("give either 'adapters' or 'lora_name'/'lora_path', not both")
        specs = [LoRAAdapterSpec(lora_name=a.lora_name, lora_path=a.lora_path, pinned=a.pinned,
                                 draft_lora_path=a.draft_lora_path) for a in body.adapters]  # fmt: skip
        if not specs:
            raise InputError("'adapters' is empty")
    else:
        if body.lora_name is None or body.lora_path is None:
            raise InputError("'lora_name' and 'lora_path' are required")
        specs = [LoRAAdapterSpec(lora_name=body.lora_name, lora_path=body.lora_path, pinned=body.pinned,
                                 draft_lora_path=body.draft_lora_path)]  # fmt: skip
    out = await service_of(request).load_adapters(specs, caller=caller_of(request))
    return adapter_reply(out, body.adapters is not None)


@routes.post("/unload_lora_adapter")
async def unload_lora_adapter(request: web.Request) -> web.Response:
    body = await read_request(request, UnloadBody)
    if (body.lora_name is None) == (body.lora_names is None):
        raise InputError("give exactly one of 'lora_name' or 'lora_names'")
    names = body.lora_names if body.lora_names is not None else [body.lora_name]
    if not names:
        raise InputError("'lora_names' is empty")
    out = await service_of(request).unload_adapters(names, caller=caller_of(request))
    return adapter_reply(out, body.lora_names is not None)


@routes.get("/audit_log")
async def audit_log(request: web.Request) -> web.Response:
    """The last adapter operations and refusals, oldest first (the console shows them; --audit-log has them all)."""
    return json_response(AuditLogResponse(entries=list(runtime_of(request).audit.recent)))


@routes.get("/lora_adapters")
async def lora_adapters(request: web.Request) -> web.Response:
    runtime = runtime_of(request)
    replicas = await replica_stats(runtime)
    slot_tables = [r.slot_lora_ids for r in replicas] if replicas is not None else None
    # task: what every adapter here serves (the console groups them by it): the pooling runner's, else generate
    return json_response({"adapters": runtime.registry.table(slot_tables), "task": serving_task(runtime.pooling)})


def serving_task(spec: PoolingSpec | None) -> str:
    """generate, embed, rerank (a classifier with one label: /score, /rerank) or classify."""
    if spec is None:
        return "generate"
    if spec.task == "classify" and spec.num_labels == 1:
        return "rerank"
    return spec.task
