"""OpenAI-compatible routes (vLLM status codes): completions, chat, models, adapter load/unload."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

import msgspec
from aiohttp import web
from loraplex.frontend.adapters.registry import AdapterError
from loraplex.frontend.constraints import ResponseFormat, constrain, openai_constraint
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
from loraplex.frontend.native_api import n_samplings, runtime_of, submit_all
from loraplex.frontend.params import (
    MAX_N,
    AdapterPath,
    Int64,
    MinP,
    Penalty,
    RepetitionPenalty,
    Seed,
    Temperature,
    TokenCount,
    TokenId,
    TopK,
    TopLogprobs,
    TopP,
    make_sampling,
    stop_list,
    strip_neutral,
)
from loraplex.frontend.request_state import OutputOptions, RequestState
from loraplex.frontend.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprob,
    ChatLogprobs,
    ChatTopLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
)
from loraplex.frontend.runtime import InputError, Runtime
from loraplex.protocol.errors import http_status
from loraplex.protocol.structs import LoRAAdapterSpec, TokenLogprob

routes = web.RouteTableDef()

# OpenAI parameters we do not implement, with the neutral values that mean "off" and are therefore accepted.
NEUTRAL = {
    "top_logprobs": (None, 0),  # completions (chat has it as a field)
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "audio": (None,),
}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CommonParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    max_tokens: TokenCount | None = None
    max_completion_tokens: TokenCount | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Seed | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1
    user: str | None = None
    ignore_eos: bool = False
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    min_p: MinP = 0.0
    min_tokens: TokenCount = 0
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None  # structured output (frontend/constraints.py), or one of:
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(CommonParams, kw_only=True):
    prompt: str | list[str | TokenId | list[TokenId]]  # text, texts, token ids, or lists of token ids
    logprobs: TopLogprobs | None = None  # each output token's logprob and this many alternatives
    echo: bool = False  # the prompt's text before the completion (and its tokens' logprobs, with logprobs)


class TextPart(msgspec.Struct, kw_only=True):
    type: Literal["text"]  # the only content part supported
    text: str


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatRequest(CommonParams, kw_only=True):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None  # needs logprobs: true


def requested_logprobs(req: CommonParams) -> int:
    """SamplingParams.logprobs for an OpenAI request: -1 off, else the number of alternatives."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs and not req.logprobs:
            raise InputError("top_logprobs needs logprobs: true")
        return (req.top_logprobs or 0) if req.logprobs else -1
    logprobs = getattr(req, "logprobs", None)
    return -1 if logprobs is None else logprobs


def top_entries(state: RequestState, token: str, lp: TokenLogprob) -> dict[str, float]:
    """Completions' top_logprobs of one token, as OpenAI and vLLM give it: the chosen token, then the `logprobs`
    best (up to logprobs + 1 entries; logprobs 0: the chosen token alone). Where two ids decode to the same text,
    the first of them keeps it, so the chosen token's value is always its own."""
    top = {token: lp.logprob}
    for tid, value in zip(lp.top_ids, lp.top_logprobs, strict=True):
        top.setdefault(state.token_text(tid), value)
    return top


def completion_logprobs(
    state: RequestState, start: int, offset: int, with_prompt: bool = False
) -> tuple[CompletionLogprobs, int]:
    """The output tokens from `start` on in the completions shape, after the prompt's (echo) when with_prompt;
    text offsets count from `offset`. Also returns the offset past the last token."""
    entries = state.prompt_logprob_entries() if with_prompt else []
    entries += zip(state.output_ids[start:], state.output_logprobs[start:], strict=False)
    tokens, values, tops, offsets = [], [], [], []
    for tid, lp in entries:
        token = state.token_text(tid)
        tokens.append(token)
        values.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None else top_entries(state, token, lp))
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets), offset


def chat_logprobs(state: RequestState, start: int) -> ChatLogprobs:
    def entry(tid: int, value: float) -> ChatTopLogprob:
        token = state.token_text(tid)
        return ChatTopLogprob(token=token, logprob=value, bytes=list(token.encode("utf-8")))

    content = []
    for lp, tid in zip(state.output_logprobs[start:], state.output_ids[start:], strict=False):
        chosen = entry(tid, lp.logprob)
        tops = [entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        content.append(ChatLogprob(token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes, top_logprobs=tops))
    return ChatLogprobs(content=content)


async def read_openai(request: web.Request, schema: type[CommonParams]) -> Any:
    return await read_request(
        request, schema, lambda raw: strip_neutral(raw, set(schema.__struct_fields__), NEUTRAL, "parameter")
    )


async def resolve_model(runtime: Runtime, model: str) -> tuple[str | None, str]:
    """(adapter name or None for the base model, the name that serves it)."""
    base = runtime.config.model_name
    if model == base:
        return None, base
    name = model
    if ":" in model:
        prefix, name = model.split(":", 1)
        if prefix != base:
            raise AdapterError(f"The model `{model}` does not exist.", "not_found")
    if runtime.adapters is not None and runtime.config.lora_enabled:
        await runtime.adapters.ensure(name)  # the resolver's first use, or an evicted host copy
    entry = runtime.registry.get(name)
    if entry is None or entry.draining:
        raise AdapterError(f"The model `{model}` does not exist.", "not_found")
    return name, name


def openai_sampling(runtime: Runtime, req: CommonParams, prompt_len: int, default_max: int | None) -> Any:
    if req.n < 1 or req.n > MAX_N:
        raise InputError(f"n must be in [1, {MAX_N}], got {req.n}")
    if req.stream_options is not None and not req.stream:
        raise InputError("stream_options is only allowed with stream: true")
    if (
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and req.max_tokens != req.max_completion_tokens
    ):
        raise InputError("max_tokens and max_completion_tokens disagree")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = default_max if default_max is not None else max(1, runtime.ready.context_length - prompt_len)
    echo = getattr(req, "echo", False)
    if max_tokens < 1 and not echo:  # vLLM: with echo, max_tokens 0 returns the prompt (and its logprobs) alone
        raise InputError(f"max_tokens must be >= 1, got {max_tokens}")
    logprobs = requested_logprobs(req)
    sampling = make_sampling(
        max_new_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        ignore_eos=req.ignore_eos,
        seed=req.seed,
        stop_token_ids=req.stop_token_ids,
        eos_token_ids=runtime.eos_token_ids,
        logprobs=logprobs,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        min_p=req.min_p,
        min_new_tokens=req.min_tokens,
        logprob_start_len=0 if echo and logprobs >= 0 else -1,
    )
    return n_samplings(sampling, req.n)


def finish_reason(state: RequestState) -> str | None:
    if state.finish_reason is None:
        return None
    return {"stop": "stop", "length": "length"}.get(state.finish_reason["type"], "abort")


def usage(states: list[RequestState], num_prompt_tokens: int) -> Usage:
    """num_prompt_tokens: the request's prompts, each counted once (OpenAI, vLLM and SGLang do not count it n times)."""
    completion = sum(len(s.output_ids) for s in states)  # so far, in a stream with continuous_usage_stats
    return Usage(
        prompt_tokens=num_prompt_tokens, completion_tokens=completion, total_tokens=num_prompt_tokens + completion
    )


async def run_openai(
    request: web.Request,
    req: CommonParams,
    prompts: list[list[int]],
    chat: bool,
    default_max: int | None,
    echo_texts: list[str] | None = None,
) -> web.StreamResponse:
    """echo_texts (completions with echo): each prompt's text, put before its completions' text."""
    runtime = runtime_of(request)
    runtime.check_available()
    lora_name, served_by = await resolve_model(runtime, req.model)
    jobs: list[tuple[list[int], Any]] = []
    found = openai_constraint(req)
    for prompt in prompts:
        for sampling in await constrain(runtime, openai_sampling(runtime, req, len(prompt), default_max), found):
            jobs.append((prompt, sampling))
    echoes = [text for text in echo_texts for _ in range(req.n)] if echo_texts is not None else None
    stops = stop_list(req.stop)
    output = OutputOptions(skip_special_tokens=req.skip_special_tokens, keep_stop=req.include_stop_str_in_output)
    states: list[RequestState] = []
    try:
        for prompt, sampling in jobs:
            states += await submit_all(runtime, [prompt], sampling, stops, [lora_name], [None], output)
        base = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "created": int(time.time()),
            "model": served_by,
        }
        prompt_tokens = sum(len(p) for p in prompts)  # each prompt once, however many choices share it (n)
        if req.stream:
            return await stream_openai(request, runtime, req, states, base, chat, prompt_tokens, echoes)
        await wait_all(runtime, states)
        failed = next((s for s in states if s.error), None)
        if failed is not None:
            return error_response(failed.error, failed.error_status)
        if chat:
            chat_choices = [
                ChatChoice(index=i, message=AssistantMessage(role="assistant", content=s.text),
                           logprobs=chat_logprobs(s, 0) if s.wants_logprobs else None,
                           finish_reason=finish_reason(s))
                for i, s in enumerate(states)
            ]
            return json_response(ChatCompletionResponse(
                **base, object="chat.completion", choices=chat_choices, usage=usage(states, prompt_tokens)
            ))
        choices = [
            CompletionChoice(index=i, text=(echoes[i] if echoes else "") + s.text, finish_reason=finish_reason(s),
                             logprobs=completion_logprobs(s, 0, 0, bool(echoes))[0] if s.wants_logprobs else None)
            for i, s in enumerate(states)
        ]
        return json_response(CompletionResponse(
            **base, object="text_completion", choices=choices, usage=usage(states, prompt_tokens)
        ))
    finally:
        for state in states:
            await runtime.finish(state)


async def stream_openai(
    request: web.Request,
    runtime: Runtime,
    req: CommonParams,
    states: list[RequestState],
    base: dict,
    chat: bool,
    prompt_tokens: int,
    echoes: list[str] | None = None,
) -> web.StreamResponse:
    resp = await start_sse(request)
    sent = [0] * len(states)
    sent_logprobs = [0] * len(states)  # output tokens whose logprobs went out
    offsets = [0] * len(states)  # completions' text_offset of the next token
    echoed = [not echoes] * len(states)  # the prompt's text (and logprobs) go out with a choice's first chunk
    # vLLM's continuous_usage_stats: with include_usage, the usage so far in every chunk too
    options = req.stream_options
    continuous = options is not None and options.include_usage and options.continuous_usage_stats

    def chunk(choices: list, usage_: Usage | None = None) -> CompletionChunk | ChatCompletionChunk:
        if continuous and usage_ is None:
            usage_ = usage(states, prompt_tokens)
        if chat:
            return ChatCompletionChunk(**base, object="chat.completion.chunk", choices=choices, usage=usage_)
        return CompletionChunk(**base, object="text_completion", choices=choices, usage=usage_)

    if chat:
        for i in range(len(states)):
            delta = ChatDelta(role="assistant", content="")
            await send_sse(resp, chunk([ChatChunkChoice(index=i, delta=delta, logprobs=None, finish_reason=None)]))
    async for i, state in stream_many(runtime, states):
        if state.error:
            await send_sse(resp, error_body(state.error, state.error_status))
            continue
        delta_text = state.text[sent[i] :]
        sent[i] = len(state.text)
        reason = finish_reason(state)
        start = sent_logprobs[i]
        new_logprobs = state.wants_logprobs and len(state.output_logprobs) > start
        sent_logprobs[i] = len(state.output_logprobs)
        if not delta_text and reason is None and not new_logprobs:
            continue
        with_prompt = not echoed[i]
        if with_prompt:
            delta_text, echoed[i] = echoes[i] + delta_text, True
        if chat:
            delta = ChatDelta(content=delta_text) if delta_text else ChatDelta()
            chat_lp = chat_logprobs(state, start) if state.wants_logprobs else None
            choice = ChatChunkChoice(index=i, delta=delta, logprobs=chat_lp, finish_reason=reason)
        else:
            completion_lp = None
            if state.wants_logprobs:
                completion_lp, offsets[i] = completion_logprobs(state, start, offsets[i], with_prompt)
            choice = CompletionChoice(index=i, text=delta_text, logprobs=completion_lp, finish_reason=reason)
        await send_sse(resp, chunk([choice]))
    if req.stream_options is not None and req.stream_options.include_usage:
        await send_sse(resp, chunk([], usage(states, prompt_tokens)))
    await send_sse_done(resp)
    return resp


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    runtime = runtime_of(request)
    req = await read_openai(request, CompletionRequest)
    prompt = req.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise InputError("'prompt' is empty")
    if all(isinstance(p, str) for p in prompt):
        prompts = [runtime.tokenize(p) for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    elif all(isinstance(p, list) and p for p in prompt):
        prompts = prompt
    else:
        raise InputError("'prompt' must be a string, a list of strings, token ids, or lists of token ids")
    echo_texts = None
    if req.echo:  # a text prompt is echoed as it came, token ids as they decode
        echo_texts = [p if isinstance(p, str) else runtime.tokenizer.decode(ids, skip_special_tokens=False)
                      for p, ids in zip(prompt if isinstance(prompt[0], str) else prompts, prompts, strict=True)]
    return await run_openai(request, req, prompts, chat=False, default_max=16, echo_texts=echo_texts)


def chat_prompt(runtime: Runtime, messages: list[ChatMessage]) -> list[int]:
    if not messages:
        raise InputError("'messages' is empty")
    if not getattr(runtime.tokenizer, "chat_template", None):
        raise InputError(f"model {runtime.config.model_name!r} has no chat template, so it cannot take 'messages'")
    rendered = []
    for m in messages:
        content = "".join(part.text for part in m.content) if isinstance(m.content, list) else m.content
        rendered.append({"role": m.role, "content": content or ""})
    try:
        text = runtime.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template that rejects these messages is a client error
        raise InputError(f"the chat template rejected the messages: {e}") from e
    return runtime.tokenizer(text, add_special_tokens=False)["input_ids"]


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    runtime = runtime_of(request)
    req = await read_openai(request, ChatRequest)
    prompt = chat_prompt(runtime, req.messages)
    return await run_openai(request, req, [prompt], chat=True, default_max=None)


def model_cards(runtime: Runtime) -> list[ModelCard]:
    """The base model's card, then one per adapter being served."""
    base = runtime.config.model_name
    created = int(time.time())
    cards = [
        ModelCard(id=base, object="model", created=created, owned_by="loraplex", root=runtime.model_dir, parent=None,
                  max_model_len=runtime.ready.context_length if runtime.ready else None)
    ]
    cards += [
        ModelCard(id=entry.name, object="model", created=created, owned_by="loraplex", root=entry.path,
                  parent=entry.parent or base)
        for entry in runtime.registry.live()
        if not entry.draining
    ]
    return cards


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


class VllmLoadBody(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: AdapterPath
    load_inplace: bool = False
    pinned: bool | None = None  # None: a new adapter is unpinned, an in-place reload keeps its own


class VllmUnloadBody(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: Int64 | None = None  # accepted for vLLM clients, unused


@routes.post("/v1/load_lora_adapter")
async def vllm_load(request: web.Request) -> web.Response:
    body = await read_request(request, VllmLoadBody)
    runtime = runtime_of(request)
    runtime.check_available()
    spec = LoRAAdapterSpec(lora_name=body.lora_name, lora_path=body.lora_path, pinned=body.pinned)
    out = await runtime.adapters.load([spec], load_inplace=body.load_inplace)
    result = out.results[0]
    if result.success:
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")
    return error_response(result.error_message, http_status(result.error_kind, openai=True))


@routes.post("/v1/unload_lora_adapter")
async def vllm_unload(request: web.Request) -> web.Response:
    body = await read_request(request, VllmUnloadBody)
    runtime = runtime_of(request)
    runtime.check_available()
    out = await runtime.adapters.unload([body.lora_name])
    result = out.results[0]
    if result.success:
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
    return error_response(result.error_message, http_status(result.error_kind, openai=True))
