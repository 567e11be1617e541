"""OpenAI-compatible routes (vLLM status codes): completions, chat, models, adapter load/unload."""

from __future__ import annotations

from aiohttp import web
from loraplex.frontend.adapters.registry import AdapterError
from loraplex.frontend.bodies import ModelList
from loraplex.frontend.entrypoints.http_utils import (
    caller_of,
    error_response,
    json_response,
    read_request,
    runtime_of,
    send_sse,
    send_sse_done,
    service_of,
    start_sse,
)
from loraplex.frontend.generate import GenerationFailed
from loraplex.frontend.openai.schemas import (
    ChatRequest,
    CompletionRequest,
    VllmLoadBody,
    VllmUnloadBody,
    strip_openai,
)
from loraplex.frontend.openai.serving import OpenAIRun, model_cards, start_chat, start_completion
from loraplex.protocol.errors import http_status
from loraplex.protocol.structs import LoRAAdapterSpec

routes = web.RouteTableDef()


async def reply(request: web.Request, run: OpenAIRun) -> web.StreamResponse:
    """The answer as JSON, or as Server-Sent Events with stream: true; the run's states end either way."""
    try:
        if not run.stream:
            try:
                return json_response(await run.response())
            except GenerationFailed as e:
                return error_response(str(e), e.status)
        resp = await start_sse(request)
        async for event in run.chunks():
            await send_sse(resp, event)
        await send_sse_done(resp)
        return resp
    finally:
        await run.close()


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    req = await read_request(request, CompletionRequest, strip_openai(CompletionRequest))
    return await reply(request, await start_completion(service_of(request), req))


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = await read_request(request, ChatRequest, strip_openai(ChatRequest))
    return await reply(request, await start_chat(service_of(request), req))


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    return json_response(ModelList(object="list", data=model_cards(runtime_of(request))))


@routes.get("/v1/models/{model:.+}")  # a served name may hold slashes (org/name)
async def model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    card = next((c for c in model_cards(runtime_of(request)) if c.id == name), None)
    if card is None:
        raise AdapterError(f"The model `{name}` does not exist.", "not_found")
    return json_response(card)


@routes.post("/v1/load_lora_adapter")
async def vllm_load(request: web.Request) -> web.Response:
    body = await read_request(request, VllmLoadBody)
    spec = LoRAAdapterSpec(lora_name=body.lora_name, lora_path=body.lora_path, pinned=body.pinned,
                           draft_lora_path=body.draft_lora_path)
    out = await service_of(request).load_adapters([spec], load_inplace=body.load_inplace, caller=caller_of(request))
    result = out.results[0]
    if result.success:
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")
    return error_response(result.error_message, http_status(result.error_kind, openai=True))


@routes.post("/v1/unload_lora_adapter")
async def vllm_unload(request: web.Request) -> web.Response:
    body = await read_request(request, VllmUnloadBody)
    out = await service_of(request).unload_adapters([body.lora_name], caller=caller_of(request))
    result = out.results[0]
    if result.success:
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
    return error_response(result.error_message, http_status(result.error_kind, openai=True))
