"""Native, SGLang-compatible routes: /generate, adapters, abort, health and info."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web
from loraplex.frontend.adapters.registry import AdapterError
from loraplex.frontend.constraints import constrain, native_constraint
from loraplex.frontend.http_utils import (
    error_body,
    error_response,
    json_response,
    read_request,
    send_sse,
    send_sse_done,
    start_sse,
    stream_many,
    wait_all,
)
from loraplex.frontend.metrics import combine_stats
from loraplex.frontend.params import (
    MAX_SEED,
    AdapterPath,
    NativeGenerateRequest,
    NativeSamplingParams,
    native_sampling,
    strip_native,
)
from loraplex.frontend.request_state import OutputOptions, RequestState
from loraplex.frontend.responses import AbortResponse, AdapterReply, AdapterResult, HealthResponse, ModelInfoResponse
from loraplex.frontend.runtime import InputError, Runtime
from loraplex.protocol.errors import http_status
from loraplex.protocol.structs import (
    AbortReqOutput,
    LoadLoRAAdapterReqOutput,
    LoRAAdapterSpec,
    SamplingParams,
    SchedulerStats,
    UnloadLoRAAdapterReqOutput,
)

routes = web.RouteTableDef()


def runtime_of(request: web.Request) -> Runtime:
    return request.app["runtime"]


def generate_items(runtime: Runtime, body: NativeGenerateRequest) -> tuple[list[list[int]], bool]:
    """Prompts as token ids, and whether the request was batched."""
    if (body.text is None) == (body.input_ids is None):
        raise InputError("give exactly one of 'text' or 'input_ids'")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        if not texts:
            raise InputError("'text' is an empty list")
        return [runtime.tokenize(t) for t in texts], not isinstance(body.text, str)
    ids = body.input_ids
    if not ids:
        raise InputError("'input_ids' is empty")
    if all(isinstance(t, list) for t in ids):
        if any(not p for p in ids):
            raise InputError("'input_ids' holds an empty prompt")
        return ids, True
    if any(isinstance(t, list) for t in ids):
        raise InputError("'input_ids' must be a list of ints or a list of lists of ints, not a mix")
    return [ids], False


def per_item(value: Any, count: int, batched: bool, what: str) -> list[Any]:
    if isinstance(value, list):
        if not batched or len(value) != count:
            raise InputError(f"'{what}' is a list of {len(value)} but the request has {count} prompt(s)")
        return value
    if what == "rid" and value is not None and batched:
        raise InputError("a batched request needs a list of rids")
    return [value] * count


async def submit_all(runtime: Runtime, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
                     stops: list[str], lora_names: list[str | None], rids: list[str | None],
                     output: OutputOptions = OutputOptions()) -> list[RequestState]:
    """Submit every prompt (with its own sampling when given a list), or none if one is refused."""
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    batch = list(dict.fromkeys(name for name in lora_names if name is not None))  # distinct, in item order
    if batch and runtime.config.lora_enabled:
        runtime.adapters.check_batch(batch)
    states: list[RequestState] = []
    # Until every item holds its adapter, the batch's adapters are the last any other load may evict.
    runtime.registry.want(batch)
    try:
        # Check every adapter first so a bad name in a batch starts nothing; bringing one back evicts none of the rest.
        for name in batch:
            if runtime.config.lora_enabled:
                await runtime.adapters.ensure(name, batch)  # the resolver's first use, or an evicted host copy
            if runtime.registry.get(name) is None or runtime.registry.get(name).draining:
                raise AdapterError(f"adapter {name!r} is not loaded", kind="not_found")
        for prompt, one_sampling, name, rid in zip(prompts, samplings, lora_names, rids, strict=False):
            states.append(await runtime.submit(prompt, one_sampling, stops, name, rid, output))
    except BaseException:
        for state in states:
            await runtime.finish(state)
        raise
    finally:
        runtime.registry.unwant(batch)
    return states


def generate_response(state: RequestState, logprobs_from: int = 0, input_logprobs_from: int = 0) -> dict:
    return {"text": state.text, "output_ids": list(state.output_ids),
            "meta_info": state.meta_info(logprobs_from, input_logprobs_from)}


def repeat_n(values: list[Any], n: int) -> list[Any]:
    """n results per prompt, prompt-major."""
    return [v for v in values for _ in range(n)]


def n_samplings(sampling: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of each of n results of one prompt: a seeded request's k-th draws with seed + k (both APIs)."""
    if sampling.seed is None:
        return [sampling] * n
    return [msgspec.structs.replace(sampling, seed=(sampling.seed + k) % (MAX_SEED + 1)) for k in range(n)]


async def start_generate(runtime: Runtime, body: NativeGenerateRequest) -> tuple[list[RequestState], bool]:
    """Validate and submit a /generate body (HTTP, Engine and RPC alike): (states, batched). With n > 1, n results
    per prompt in one flat list, prompt-major (always a list)."""
    runtime.check_available()
    prompts, batched = generate_items(runtime, body)
    logprobs = body.top_logprobs_num if body.return_logprob else -1
    logprob_start_len = body.logprob_start_len if body.return_logprob else -1
    params = body.sampling_params or NativeSamplingParams()
    sampling, stops = native_sampling(params, runtime.eos_token_ids, logprobs, logprob_start_len)
    [sampling] = await constrain(runtime, [sampling], native_constraint(params))
    lora_names = per_item(body.lora_path, len(prompts), batched, "lora_path")
    rids = per_item(body.rid, len(prompts), batched, "rid")
    if params.n > 1:
        rids = [None if rid is None else f"{rid}-{k}" for rid in rids for k in range(params.n)]
        prompts, lora_names, batched = repeat_n(prompts, params.n), repeat_n(lora_names, params.n), True
    samplings = n_samplings(sampling, params.n) * (len(prompts) // params.n)
    output = OutputOptions(skip_special_tokens=params.skip_special_tokens, keep_stop=params.no_stop_trim)
    states = await submit_all(runtime, prompts, samplings, stops, lora_names, rids, output)
    for state in states:
        state.return_text_in_logprobs = body.return_text_in_logprobs
    return states, batched


def raise_failure(states: list[RequestState]) -> None:
    failed = next((s for s in states if s.error), None)
    if failed is not None:
        raise GenerationFailed(failed.error, failed.error_status)


class GenerationFailed(Exception):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


async def collect(runtime: Runtime, states: list[RequestState], batched: bool) -> dict | list[dict]:
    await wait_all(runtime, states)
    raise_failure(states)
    outputs = [generate_response(s) for s in states]
    return outputs if batched else outputs[0]


async def stream_chunks(runtime: Runtime, states: list[RequestState], batched: bool):
    sent = [0] * len(states)  # output tokens whose logprob entries went out already: a chunk carries its own
    sent_input = [0] * len(states)  # ... and prompt logprob entries
    async for index, state in stream_many(runtime, states):
        if state.error:
            chunk = msgspec.to_builtins(error_body(state.error, state.error_status))
        else:
            chunk = generate_response(state, sent[index], sent_input[index])
            sent[index] = len(state.output_logprobs)
            sent_input[index] = state.num_prompt_logprob_entries
        if batched:
            chunk["index"] = index
        yield chunk


@routes.post("/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    runtime = runtime_of(request)
    runtime.check_available()
    body = await read_request(request, NativeGenerateRequest, strip_native)
    states, batched = await start_generate(runtime, body)
    try:
        if not body.stream:
            try:
                return json_response(await collect(runtime, states, batched))
            except GenerationFailed as e:
                return error_response(str(e), e.status)
        resp = await start_sse(request)
        async for chunk in stream_chunks(runtime, states, batched):
            await send_sse(resp, chunk)
        await send_sse_done(resp)
        return resp
    finally:
        for state in states:
            await runtime.finish(state)


class AbortBody(msgspec.Struct, forbid_unknown_fields=True):
    rid: str


async def abort(runtime: Runtime, rid: str) -> AbortReqOutput:
    """/abort_request and the RPC's AbortReqInput alike."""
    found = await runtime.abort(rid)
    return AbortReqOutput(success=found, rid=rid, message="" if found else f"no request {rid!r} in flight")


@routes.post("/abort_request")
async def abort_request(request: web.Request) -> web.Response:
    body = await read_request(request, AbortBody)
    out = await abort(runtime_of(request), body.rid)
    # 200 either way, as SGLang does: the request may have finished a moment before the abort arrived.
    return json_response(AbortResponse(success=out.success, rid=out.rid, message=out.message))


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    runtime = runtime_of(request)
    if runtime.healthy:
        return json_response(HealthResponse(status="ok"))
    reason = runtime.failure or ("shutting down" if runtime.stopping or runtime.draining else "starting")
    return json_response(HealthResponse(status="unhealthy", reason=reason), 503)


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
    for secret in ("api_key", "admin_api_key"):
        config[secret] = None if config[secret] is None else "***"
    ready = runtime.ready
    replicas = await replica_stats(runtime)
    capacities = [r.max_total_tokens for r in runtime.replica_ready]
    stats = combine_stats(replicas, capacities) if replicas else None
    return json_response({
        **config,
        "model_dir": runtime.model_dir,
        "served_model_name": runtime.config.model_name,
        "max_total_tokens": sum(capacities) if ready else None,  # over all replicas
        "context_length": ready.context_length if ready else None,
        "vocab_size": ready.vocab_size if ready else None,
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


class AdapterSpecBody(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: AdapterPath
    pinned: bool = False


class LoadBody(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str | None = None
    lora_path: AdapterPath | None = None
    pinned: bool = False
    adapters: list[AdapterSpecBody] | None = None


class UnloadBody(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str | None = None
    lora_names: list[str] | None = None


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
    out = await runtime.adapters.load(specs)
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
    out = await runtime.adapters.unload(names)
    return adapter_reply(out, body.lora_names is not None)


@routes.get("/lora_adapters")
async def lora_adapters(request: web.Request) -> web.Response:
    runtime = runtime_of(request)
    replicas = await replica_stats(runtime)
    slot_tables = [r.slot_lora_ids for r in replicas] if replicas is not None else None
    return json_response({"adapters": runtime.registry.table(slot_tables)})
