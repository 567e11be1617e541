"""The OpenAI API without HTTP: sampling, logprobs, and one completions or chat request from its body to its answer,
whole or as stream chunks. The aiohttp routes (openai_api.py) and the Ray replica (ray_serve.py) serve it."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from loraplex.frontend.bodies import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    ModelCard,
    PromptTokensDetails,
    Usage,
    error_body,
)
from loraplex.frontend.constraints import Found, constrain, openai_constraint
from loraplex.frontend.detokenizer import text_offsets
from loraplex.frontend.errors import InputError
from loraplex.frontend.generate import GenerateService, n_samplings, raise_failure
from loraplex.frontend.openai.logprobs import Echo, chat_logprobs, completion_logprobs, prompt_logprobs
from loraplex.frontend.openai.schemas import (
    ChatRequest,
    CommonParams,
    CompletionRequest,
    chat_messages,
    chat_options,
)
from loraplex.frontend.params import (
    MAX_N,
    logit_controls,
    make_sampling,
    stop_list,
)
from loraplex.frontend.reasoning import Reasoning, constraint_after_reasoning, request_reasoning
from loraplex.frontend.request_state import OutputOptions, RequestState
from loraplex.frontend.runtime import Runtime
from loraplex.frontend.tools.request import ToolPlan, tool_plan
from loraplex.frontend.tools.stream import ToolCallStream, tool_answer


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
        controls=logit_controls(req.logit_bias, req.allowed_token_ids, req.bad_words, runtime.tokenizer,
                                runtime.ready.vocab_size),
    )
    return n_samplings(sampling, req.n)


def finish_reason(state: RequestState) -> str | None:
    if state.finish_reason is None:
        return None
    return {"stop": "stop", "length": "length"}.get(state.finish_reason["type"], "abort")


def usage(states: list[RequestState], num_prompt_tokens: int, n: int) -> Usage:
    """num_prompt_tokens: the request's prompts, each counted once (OpenAI, vLLM and SGLang do not count it n times);
    so are their cached tokens, as the first of each prompt's n choices found them (states hold n per prompt)."""
    completion = sum(len(s.output_ids) for s in states)  # so far, in a stream with continuous_usage_stats
    cached = sum(s.num_cached_prompt_tokens for s in states[::n])
    return Usage(
        prompt_tokens=num_prompt_tokens, completion_tokens=completion, total_tokens=num_prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


class OpenAIRun:
    """One completions or chat request, submitted: its answer whole (response) or as stream chunks; close() ends
    every state, on every path."""

    def __init__(self, service: GenerateService, req: CommonParams, states: list[RequestState], chat: bool,
                 served_by: str, prompt_tokens: int, echoes: list[Echo] | None, reasoning: Reasoning | None = None,
                 tools: ToolPlan | None = None):
        self.service = service
        self.tools = tools  # chat with tool calls: how its output becomes calls
        self.req = req
        self.states = states
        self.chat = chat
        self.prompt_tokens = prompt_tokens  # each prompt once, however many choices share it (n)
        self.echoes = echoes  # completions with echo: each choice's prompt, its text put before the choice's
        self.reasoning = reasoning  # chat under --reasoning-parser: <think> text goes to reasoning_content
        # vLLM's prompt_logprobs (completions' echo with logprobs too): alternatives per prompt token, or None
        self.num_prompt_top = requested_prompt_logprobs(req, requested_logprobs(req))
        self.base = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, "created": int(time.time()),
                     "model": served_by}

    @property
    def stream(self) -> bool:
        return self.req.stream

    async def close(self) -> None:
        await self.service.finish(self.states)

    async def response(self) -> CompletionResponse | ChatCompletionResponse:
        """The whole answer once every choice finished; GenerationFailed if one failed."""
        states, echoes = self.states, self.echoes
        await self.service.wait(states)
        raise_failure(states)
        ids = bool(self.req.return_token_ids)
        num_prompt_top = self.num_prompt_top
        prompts = [None if num_prompt_top is None else prompt_logprobs(s, num_prompt_top) for s in states]
        if self.chat:
            chat_choices = []
            for i, s in enumerate(states):
                message = self.message(s.text)
                if self.tools is not None:  # tool calls are read in the answer, after any reasoning
                    message.content, message.tool_calls = tool_answer(message.content or "", self.tools)
                reason = finish_reason(s)
                reason = "tool_calls" if message.tool_calls and reason == "stop" else reason
                chat_choices.append(ChatChoice(
                    index=i, message=message, logprobs=chat_logprobs(s, 0) if s.wants_logprobs else None,
                    finish_reason=reason, token_ids=list(s.output_ids) if ids else None))
            return ChatCompletionResponse(**self.base, object="chat.completion", choices=chat_choices,
                                          usage=usage(states, self.prompt_tokens, self.req.n),
                                          prompt_token_ids=states[0].prompt_ids if ids else None,
                                          prompt_logprobs=prompts[0])
        choices = [
            CompletionChoice(index=i, text=(echoes[i].text if echoes else "") + s.text, finish_reason=finish_reason(s),
                             logprobs=completion_logprobs(s, 0, echoes[i] if echoes else None, True)
                             if s.wants_logprobs else None,
                             prompt_token_ids=s.prompt_ids if ids else None,
                             token_ids=list(s.output_ids) if ids else None, prompt_logprobs=prompts[i])
            for i, s in enumerate(states)
        ]
        return CompletionResponse(**self.base, object="text_completion", choices=choices,
                                  usage=usage(states, self.prompt_tokens, self.req.n))

    def message(self, text: str) -> AssistantMessage:
        if self.reasoning is None:
            return AssistantMessage(role="assistant", content=text)
        reasoning, content = self.reasoning.parser().split(text)
        return AssistantMessage(role="assistant", content=content, reasoning_content=reasoning)

    async def chunks(self) -> AsyncIterator[Any]:
        """The stream's events in order (an error body where a choice failed), before the closing [DONE]."""
        states, echoes, chat, req = self.states, self.echoes, self.chat, self.req
        sent = [0] * len(states)
        sent_logprobs = [0] * len(states)  # output tokens whose logprobs went out
        ids = bool(req.return_token_ids)
        sent_ids = [0] * len(states)  # output tokens whose ids went out (return_token_ids)
        prompt_ids_sent = [False] * len(states)  # completions: a choice's prompt ids go with its first chunk
        echoed = [not echoes] * len(states)  # the prompt's text (and logprobs) go out with a choice's first chunk
        # vLLM's continuous_usage_stats: with include_usage, the usage so far in every chunk too
        parsers = [self.reasoning.parser() for _ in states] if chat and self.reasoning else None
        options = req.stream_options
        continuous = options is not None and options.include_usage and options.continuous_usage_stats
        tool_streams = None if self.tools is None else [ToolCallStream(self.tools, whole_calls=True) for _ in states]
        answers = [""] * len(states)  # with tool calls: each choice's answer so far, its reasoning left out

        def chunk(choices: list, usage_: Usage | None = None) -> CompletionChunk | ChatCompletionChunk:
            if continuous and usage_ is None:
                usage_ = usage(states, self.prompt_tokens, self.req.n)
            if chat:
                return ChatCompletionChunk(**self.base, object="chat.completion.chunk", choices=choices, usage=usage_)
            return CompletionChunk(**self.base, object="text_completion", choices=choices, usage=usage_)

        if chat:
            for i in range(len(states)):
                delta = ChatDelta(role="assistant", content="")
                first = chunk([ChatChunkChoice(index=i, delta=delta, logprobs=None, finish_reason=None)])
                if ids and i == 0:
                    first.prompt_token_ids = states[0].prompt_ids
                yield first
        async for i, state in self.service.stream(states):
            if state.error:
                yield error_body(state.error, state.error_status)
                continue
            delta_text = state.text[sent[i] :]
            sent[i] = len(state.text)
            reason = finish_reason(state)
            reasoning_text = ""
            if parsers:  # a partial tag waits for the next piece; the last piece releases it
                reasoning_text, delta_text = parsers[i].feed(delta_text)
                if reason is not None:
                    rest_reasoning, rest_content = parsers[i].flush()
                    reasoning_text, delta_text = reasoning_text + rest_reasoning, delta_text + rest_content
            start = sent_logprobs[i]
            new_logprobs = state.wants_logprobs and len(state.output_logprobs) > start
            sent_logprobs[i] = len(state.output_logprobs)
            new_ids = state.output_ids[sent_ids[i] :] if ids else None
            sent_ids[i] = len(state.output_ids)
            if tool_streams is not None:  # the answer goes out as content and tool call deltas, one chunk each
                answers[i] += delta_text
                pieces = tool_streams[i].update(answers[i], state.finished)
                reason = "tool_calls" if reason == "stop" and tool_streams[i].has_calls else reason
                if reasoning_text:
                    yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(reasoning_content=reasoning_text),
                                                 logprobs=None, finish_reason=None)])
                if not pieces and reason is None and not new_logprobs and not new_ids:
                    continue
                pieces = pieces or [("", [])]
                for k, (content, calls) in enumerate(pieces):
                    last = k == len(pieces) - 1
                    delta = ChatDelta(content=content or None, tool_calls=calls or None)
                    yield chunk([ChatChunkChoice(
                        index=i, delta=delta, logprobs=chat_logprobs(state, start) if last and new_logprobs else None,
                        finish_reason=reason if last else None, token_ids=new_ids if last else None)])
                continue
            if not delta_text and not reasoning_text and reason is None and not new_logprobs and not new_ids:
                continue
            with_prompt = not echoed[i]
            if with_prompt:
                delta_text, echoed[i] = echoes[i].text + delta_text, True
            if chat:
                delta = ChatDelta(content=delta_text or None, reasoning_content=reasoning_text or None)
                chat_lp = chat_logprobs(state, start) if state.wants_logprobs else None
                choice = ChatChunkChoice(index=i, delta=delta, logprobs=chat_lp, finish_reason=reason,
                                         token_ids=new_ids)
            else:
                completion_lp = None
                if state.wants_logprobs:
                    completion_lp = completion_logprobs(state, start, echoes[i] if echoes else None, with_prompt)
                choice = CompletionChoice(index=i, text=delta_text, logprobs=completion_lp, finish_reason=reason,
                                          token_ids=new_ids)
                if ids and not prompt_ids_sent[i]:
                    choice.prompt_token_ids, prompt_ids_sent[i] = state.prompt_ids, True
            yield chunk([choice])
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage(states, self.prompt_tokens, self.req.n))


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
) -> OpenAIRun:
    """Validate and submit every choice (n per prompt), or none. echoes (completions with echo): each prompt's,
    its text put before its completions' text. found: a constraint the caller derived (/v1/responses' forced tool
    call), else the body's structured-output fields give it. tools: a chat's tool calls (a forced choice constrains
    the output). reasoning: the constraint starts after the reasoning."""
    runtime = service.runtime
    runtime.check_available()
    lora_name, served_by = await service.resolve_model(req.model)
    jobs: list[tuple[list[int], Any]] = []
    found = found or openai_constraint(req)
    if tools is not None and tools.constraint is not None:
        if found is not None:
            raise InputError(f"tool_choice required or named forces the output's shape: {found.field} cannot be "
                             "given with it")
        found = Found(tools.constraint, "tool_choice")
    found = constraint_after_reasoning(found, reasoning)
    for prompt in prompts:
        for sampling in await constrain(runtime, openai_sampling(runtime, req, len(prompt), default_max), found):
            jobs.append((prompt, sampling))
    echoes = [echo for echo in echoes for _ in range(req.n)] if echoes is not None else None
    stops = stop_list(req.stop)
    skip_special = req.skip_special_tokens and not (tools is not None and tools.parser.needs_special_tokens)
    output = OutputOptions(skip_special_tokens=skip_special, keep_stop=req.include_stop_str_in_output)
    states: list[RequestState] = []
    refund = service.take_rate([prompt for prompt, _ in jobs])
    try:
        for prompt, sampling in jobs:
            states += await service.submit([prompt], sampling, stops, [lora_name], [None], output,
                                           priority=req.priority)
    except BaseException:
        refund()
        await service.finish(states)
        raise
    return OpenAIRun(service, req, states, chat, served_by, sum(len(p) for p in prompts), echoes, reasoning, tools)


async def start_completion(service: GenerateService, req: CompletionRequest) -> OpenAIRun:
    prompt = req.prompt
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise InputError("'prompt' is empty")
    if all(isinstance(p, str) for p in prompt):
        prompts = [service.tokenize(p) for p in prompt]
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
            offsets = text_offsets(service.runtime.tokenizer, ids, is_text) if with_offsets else []
            echoes.append(Echo(p if is_text else service.detokenize(ids), offsets))
    return await start_openai(service, req, prompts, chat=False, default_max=16, echoes=echoes)


async def start_chat(service: GenerateService, req: ChatRequest) -> OpenAIRun:
    runtime = service.runtime
    config = runtime.config
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                     config.tool_call_parser if config.enable_auto_tool_choice else None)
    prompt = service.tokenize_chat(chat_messages(req.messages), chat_options(req))
    reasoning = request_reasoning(config.reasoning_parser, req.chat_template_kwargs, runtime.tokenizer)
    return await start_openai(service, req, [prompt], chat=True, default_max=None, reasoning=reasoning, tools=plan)


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
