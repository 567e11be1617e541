"""The OpenAI API without HTTP: one completions or chat request from its body to its sampling, its submitted
choices, and its answer, whole or as stream chunks (writers.py shapes both). The aiohttp routes
(entrypoints/openai_api.py) and the Ray replica (entrypoints/ray_serve.py) serve it."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from loraplex.frontend.adapters.mixes import mix_error
from loraplex.frontend.bodies import (
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    error_body,
)
from loraplex.frontend.constraints import Found, openai_constraint
from loraplex.frontend.detokenizer import text_offsets
from loraplex.frontend.errors import InputError
from loraplex.frontend.generate import GenerateService, n_samplings, raise_failure
from loraplex.frontend.multimodal.prompt import PromptImages
from loraplex.frontend.openai.logprobs import Echo
from loraplex.frontend.openai.schemas import (
    ChatRequest,
    CommonParams,
    CompletionRequest,
    chat_images,
    chat_messages,
    chat_options,
)
from loraplex.frontend.openai.writers import ChatWriter, CompletionWriter
from loraplex.frontend.params import (
    MAX_N,
    LoRAMixBody,
    logit_controls,
    make_sampling,
    stop_list,
)
from loraplex.frontend.reasoning import Reasoning, constraint_after_reasoning, request_reasoning
from loraplex.frontend.request_state import OutputOptions, RequestState
from loraplex.frontend.runtime import Runtime
from loraplex.frontend.tools.request import ToolPlan, tool_plan


def requested_logprobs(req: CommonParams) -> int:
    """SamplingParams.logprobs for an OpenAI request: -1 off, else the number of alternatives."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs and not req.logprobs:
            raise InputError("top_logprobs needs logprobs: true")
        return (req.top_logprobs or 0) if req.logprobs else -1
    logprobs = getattr(req, "logprobs", None)
    return -1 if logprobs is None else logprobs


def requested_prompt_logprobs(req: CommonParams, logprobs: int) -> int | None:
    """The alternatives per prompt token of vLLM's prompt_logprobs (None: no prompt logprobs); completions' echo
    with logprobs asks them at `logprobs`, as vLLM does. They come in the whole answer only (vLLM's rule)."""
    if req.prompt_logprobs is not None and req.stream:
        raise InputError("prompt_logprobs are not available with stream: true")
    if req.prompt_logprobs is None and getattr(req, "echo", False) and logprobs >= 0:
        return logprobs
    return req.prompt_logprobs


def openai_sampling(runtime: Runtime, req: CommonParams, prompt_len: int, default_max: int | None,
                    tokenizer: Any = None) -> Any:
    """tokenizer: the one the request is encoded with (bad_words), the base model's unless given."""
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
    prompt_top = requested_prompt_logprobs(req, logprobs)
    if prompt_top is not None and echo:  # the echoed prompt shows `logprobs` alternatives, prompt_logprobs its own
        prompt_top = max(prompt_top, logprobs)
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
        logprob_start_len=-1 if prompt_top is None else 0,
        prompt_top_logprobs=prompt_top or 0,
        controls=logit_controls(req.logit_bias, req.allowed_token_ids, req.bad_words, tokenizer or runtime.tokenizer,
                                runtime.ready.vocab_size),
    )
    return n_samplings(sampling, req.n)


class OpenAIRun:
    """One completions or chat request, submitted: its answer whole (response) or as stream chunks, both written by
    its writer; close() ends every state, on every path."""

    def __init__(self, service: GenerateService, req: CommonParams, states: list[RequestState], chat: bool,
                 served_by: str, prompt_tokens: int, echoes: list[Echo] | None, reasoning: Reasoning | None = None,
                 tools: ToolPlan | None = None):
        self.service = service
        self.req = req
        self.states = states
        self.prompt_tokens = prompt_tokens  # each prompt once, however many choices share it (n)
        self.base = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                     "model": served_by}
        # vLLM's prompt_logprobs (completions' echo with logprobs too): alternatives per prompt token, or None
        num_prompt_top = requested_prompt_logprobs(req, requested_logprobs(req))
        self.writer: ChatWriter | CompletionWriter = (
            ChatWriter(self.base, states, prompt_tokens, req, num_prompt_top, reasoning, tools) if chat else
            CompletionWriter(self.base, states, prompt_tokens, req, num_prompt_top, echoes))

    @property
    def stream(self) -> bool:
        return self.req.stream

    async def close(self) -> None:
        await self.service.finish(self.states)

    async def response(self) -> CompletionResponse | ChatCompletionResponse:
        """The whole answer once every choice finished; GenerationFailed if one failed."""
        await self.service.wait(self.states)
        raise_failure(self.states)
        return self.writer.response()

    async def chunks(self) -> AsyncIterator[Any]:
        """The stream's events in order (an error body where a choice failed), before the closing [DONE]."""
        writer = self.writer
        cursors = [writer.cursor(i) for i in range(len(self.states))]
        for chunk in writer.opening():
            yield chunk
        async for i, state in self.service.stream(self.states):
            if state.error:
                yield error_body(state.error, state.error_status)
                continue
            for choice in writer.stream_choices(cursors[i], state):
                yield writer.chunk([choice])
        if writer.include_usage:
            yield writer.chunk([], writer.usage())



async def start_openai(
    service: GenerateService,
    req: CommonParams,
    prompts: list[list[int]],
    chat: bool,
    default_max: int | None,
    echoes: list[Echo] | None = None,
    found: Found | None = None,
    reasoning: Reasoning | None = None,
    tools: ToolPlan | None = None,
    images: list[PromptImages | None] | None = None,
) -> OpenAIRun:
    """Validate and submit every choice (n per prompt), or none. echoes (completions with echo): each prompt's,
    its text put before its completions' text. found: a constraint the caller derived (/v1/responses' forced tool
    call), else the body's structured-output fields give it. tools: a chat's tool calls (a forced choice constrains
    the output). reasoning: the constraint starts after the reasoning. images: each prompt's images (a chat's), whose
    expanded tokens the prompt is."""
    runtime = service.runtime
    lora_name, served_by = await service.resolve_model(req.model)
    adapter: str | LoRAMixBody | None = lora_name
    if req.lora_mix is not None:
        if lora_name is not None:
            raise mix_error(f"lora_mix is served on the base model: `model` names the adapter {lora_name!r}")
        adapter = req.lora_mix
    jobs: list[tuple[list[int], Any, PromptImages | None]] = []
    found = found or openai_constraint(req)
    if tools is not None and tools.constraint is not None:
        if found is not None:
            raise InputError(f"tool_choice required or named forces the output's shape: {found.field} cannot be "
                             "given with it")
        found = Found(tools.constraint, "tool_choice")
    found = constraint_after_reasoning(found, reasoning)
    for prompt, prompt_images in zip(prompts, images or [None] * len(prompts), strict=True):
        samplings = openai_sampling(runtime, req, len(prompt), default_max, service.vocabulary(adapter).tokenizer)
        for sampling in await service.constrain(samplings, found):
            jobs.append((prompt, sampling, prompt_images))
    echoes = [echo for echo in echoes for _ in range(req.n)] if echoes is not None else None
    stops = stop_list(req.stop)
    skip_special = req.skip_special_tokens and not keeps_special_tokens(reasoning, tools)
    output = OutputOptions(skip_special_tokens=skip_special, keep_stop=req.include_stop_str_in_output)
    states: list[RequestState] = []
    refund = service.take_rate([prompt for prompt, _, _ in jobs])
    try:
        for prompt, sampling, prompt_images in jobs:
            states += await service.submit([prompt], sampling, stops, [adapter], [None], output,
                                           priority=req.priority, lora_scales=[req.lora_scale],
                                           images=[prompt_images])
    except BaseException:
        refund()
        await service.finish(states)
        raise
    return OpenAIRun(service, req, states, chat, served_by, sum(len(p) for p in prompts), echoes, reasoning, tools)


def keeps_special_tokens(reasoning: Reasoning | None, tools: ToolPlan | None) -> bool:
    """Whether a parser reads special tokens (GLM-4.5's call markup, gpt-oss's harmony), so the text keeps them."""
    return (tools is not None and tools.parser.needs_special_tokens
            or reasoning is not None and reasoning.needs_special_tokens)


async def request_adapter(service: GenerateService, req: CommonParams) -> str | None:
    """The adapter whose tokenizer encodes an OpenAI request (None: the base model's; a mix is served with it)."""
    lora_name, _ = await service.resolve_model(req.model)
    return None if req.lora_mix is not None else lora_name


async def start_completion(service: GenerateService, req: CompletionRequest) -> OpenAIRun:
    lora_name = await request_adapter(service, req)
    prompt = req.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise InputError("'prompt' is empty")
    if all(isinstance(p, str) for p in prompt):
        prompts = [service.tokenize(p, lora_name) for p in prompt]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    elif all(isinstance(p, list) and p for p in prompt):
        prompts = prompt
    else:
        raise InputError("'prompt' must be a string, a list of strings, token ids, or lists of token ids")
    echoes = None
    if req.echo:  # a text prompt is echoed as it came, token ids as they decode (special tokens shown)
        with_offsets = requested_logprobs(req) >= 0
        echoes = []
        for p, ids in zip(prompt if isinstance(prompt[0], str) else prompts, prompts, strict=True):
            is_text = isinstance(p, str)
            tokenizer = service.vocabulary(lora_name).tokenizer
            offsets = text_offsets(tokenizer, ids, is_text) if with_offsets else []
            echoes.append(Echo(p if is_text else service.detokenize(ids, lora_name), offsets))
    return await start_openai(service, req, prompts, chat=False, default_max=16, echoes=echoes)


async def start_chat(service: GenerateService, req: ChatRequest) -> OpenAIRun:
    runtime = service.runtime
    config = runtime.config
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                     config.tool_call_parser if config.enable_auto_tool_choice else None)
    lora_name = await request_adapter(service, req)
    sources = chat_images(req.messages)
    service.check_images(len(sources), "messages")  # before the template or any image is read
    prompt = service.tokenize_chat(chat_messages(req.messages), chat_options(req), lora_name)
    prompt_images = await service.prompt_images(prompt, sources, "messages") if sources else None
    if prompt_images is not None:
        prompt = prompt_images.input_ids
    reasoning = request_reasoning(config.reasoning_parser, req.chat_template_kwargs,
                                  service.vocabulary(lora_name).tokenizer)
    return await start_openai(service, req, [prompt], chat=True, default_max=None, reasoning=reasoning, tools=plan,
                              images=[prompt_images])


def base_card(runtime: Runtime) -> ModelCard:
    return ModelCard(id=runtime.config.model_name, object="model", created=runtime.created, owned_by="loraplex",
                     root=runtime.model_dir, parent=None,
                     max_model_len=runtime.ready.context_length if runtime.ready else None)


def model_cards(runtime: Runtime) -> list[ModelCard]:
    """The base model's card, then one per adapter being served."""
    base = base_card(runtime)
    return [base] + [
        ModelCard(id=entry.name, object="model", created=entry.created, owned_by="loraplex", root=entry.path,
                  parent=entry.parent or base.id)
        for entry in runtime.registry.live()
        if not entry.draining
    ]
