"""Native, SGLang-compatible routes: /generate, adapters, abort, health and info."""

from __future__ import annotations

import msgspec
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
from loraplex.frontend.metrics import combine_stats
from loraplex.frontend.params import AbortBody, LoadBody, NativeGenerateRequest, UnloadBody, strip_native
from loraplex.frontend.runtime import Runtime
from loraplex.protocol.errors import http_status
from loraplex.protocol.structs import (
    LoadLoRAAdapterReqOutput,
    LoRAAdapterSpec,
    SchedulerStats,
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


async def replica_stats(runtime: Runtime) -> list[SchedulerStats] | None:
    """Each replica's counters, or None when they cannot be had (not healthy, a scheduler slow to answer): the
    info routes still render from what the frontend knows."""
    if not runtime.healthy:
        return None
    try:
        return await runtime.replica_stats()
    except Exception:  # noqa: BLE001 - see above
        return None


@routes.get("/server_info")
async def server_info(request: web.Request) -> web.Response:
    runtime = runtime_of(request)
    config = msgspec.to_builtins(runtime.config)
    for secret in ("api_key", "admin_api_key", "hf_token"):
        config[secret] = None if config[secret] is None else "***"
    ready = runtime.ready
    replicas = await replica_stats(runtime)
    capacities = [r.max_total_tokens for r in runtime.replica_ready]
    stats = combine_stats(replicas, capacities) if replicas else None
    return json_response({
        **config,
        "model_dir": runtime.model_dir,
        # the commit served: a Hub id's resolved revision, an HF-cache snapshot's; None for a plain directory
        "revision": runtime.model_files.revision if runtime.model_files else None,
        "served_model_name": runtime.config.model_name,
        "quantization": runtime.quantization,  # the method in use (config.json's), None for plain weights
        "max_total_tokens": sum(capacities) if ready else None,  # over all replicas
        "context_length": ready.context_length if ready else None,
        "vocab_size": ready.vocab_size if ready else None,
        "model_type": ready.model_type if ready else None,
        "num_hidden_layers": ready.num_hidden_layers if ready else None,  # after --hf-overrides
        "kv_bytes_per_token": ready.kv_bytes_per_token if ready else None,  # one rank's cache, every layer
        "lora_enabled": runtime.config.lora_enabled,
        "max_lora_rank": ready.max_lora_rank if ready else None,
        "lora_target_modules": ready.lora_target_modules if ready else None,
        "process_ids": runtime.procs.pids() if runtime.procs else {},
        "healthy": runtime.healthy,
        # internal counters: leak checks read these
        "num_requests_in_flight": len(runtime.requests),
        "num_adapter_entries": runtime.registry.num_entries(),
        "num_adapter_holds": runtime.registry.total_holds(),
        "slot_lora_ids": stats.slot_lora_ids if stats and len(replicas) == 1 else None,  # per replica below
        "num_running": stats.num_running if stats else None,
        "num_waiting": stats.num_waiting if stats else None,
        "kv_usage": stats.kv_usage if stats else None,
        "num_preemptions": stats.num_preemptions if stats else None,
        "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens if stats else None,
        # hybrid models' linear-attention state slots (0 and 0 for other models), beside the KV pages
        "state_slots_total": stats.num_state_slots if stats else None,
        "state_slots_free": stats.num_free_state_slots if stats else None,
        "replicas": [replica_info(runtime, dp_rank, replicas[dp_rank] if replicas else None)
                     for dp_rank in range(len(runtime.replica_ready))],
    })


def replica_info(runtime: Runtime, dp_rank: int, stats: SchedulerStats | None) -> dict:
    """One replica's row of /server_info: its scheduler's counters and what the router sent it."""
    return {
        "dp_rank": dp_rank,
        "max_total_tokens": runtime.replica_ready[dp_rank].max_total_tokens,
        "num_requests_in_flight": runtime.router.loads[dp_rank],
        "num_requests_routed": runtime.router.num_routed[dp_rank],
        "num_running": stats.num_running if stats else None,
        "num_waiting": stats.num_waiting if stats else None,
        "kv_usage": stats.kv_usage if stats else None,
        "num_preemptions": stats.num_preemptions if stats else None,
        "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens if stats else None,
        "slot_lora_ids": stats.slot_lora_ids if stats else None,
        "num_loaded_adapters": stats.num_loaded_adapters if stats else None,
        "state_slots_total": stats.num_state_slots if stats else None,
        "state_slots_free": stats.num_free_state_slots if stats else None,
    }


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
        if body.lora_name is not None or body.lora_path is not None:
            raise InputError("give either 'adapters' or 'lora_name'/'lora_path', not both")
        specs = [LoRAAdapterSpec(lora_name=a.lora_name, lora_path=a.lora_path, pinned=a.pinned)
                 for a in body.adapters]
        if not specs:
            raise InputError("'adapters' is empty")
    else:
        if body.lora_name is None or body.lora_path is None:
            raise InputError("'lora_name' and 'lora_path' are required")
        specs = [LoRAAdapterSpec(lora_name=body.lora_name, lora_path=body.lora_path, pinned=body.pinned)]
    runtime = runtime_of(request)
    runtime.check_available()
    out = await runtime.adapters.load(specs, caller=caller_of(request))
    return adapter_reply(out, body.adapters is not None)


@routes.post("/unload_lora_adapter")
async def unload_lora_adapter(request: web.Request) -> web.Response:
    body = await read_request(request, UnloadBody)
    if (body.lora_name is None) == (body.lora_names is None):
        raise InputError("give exactly one of 'lora_name' or 'lora_names'")
    names = body.lora_names if body.lora_names is not None else [body.lora_name]
    if not names:
        raise InputError("'lora_names' is empty")
    runtime = runtime_of(request)
    runtime.check_available()
    out = await runtime.adapters.unload(names, caller=caller_of(request))
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
    return json_response({"adapters": runtime.registry.table(slot_tables)})
