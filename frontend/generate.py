"""GenerateService: generation without HTTP — submit (n results per prompt included), stream or collect, abort,
tokenize and detokenize.

Every way in calls it: the native, OpenAI and utility routes, the Engine, the RPC server and the Ray replica (through
its Engine). It admits each request (the edge's checks, the adapter's hold, the replica the router picks), puts it in
the Runtime's table of requests in flight, and is the one place every request leaves it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from loraplex.frontend.adapters.registry import AdapterError
from loraplex.frontend.bodies import error_body
from loraplex.frontend.caller import caller_key_id
from loraplex.frontend.chat_template import ChatOptions, render_chat
from loraplex.frontend.constraints import constrain, native_constraint
from loraplex.frontend.errors import InputError
from loraplex.frontend.params import MAX_SEED, NativeGenerateRequest, NativeSamplingParams, native_sampling
from loraplex.frontend.request_state import OutputOptions, RequestState
from loraplex.frontend.runtime import Runtime
from loraplex.protocol.request_limits import request_fit_error
from loraplex.protocol.structs import AbortReq, AbortReqOutput, SamplingParams, TokenizedGenerateReq


class GenerationFailed(Exception):
    """A request failed after it was admitted (a process died, a grammar broke): the status it answers with."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def n_samplings(sampling: SamplingParams, n: int) -> list[SamplingParams]:
    """The sampling of each of n results of one prompt: a seeded request's k-th draws with seed + k (both APIs)."""
    if sampling.seed is None:
        return [sampling] * n
    return [msgspec.structs.replace(sampling, seed=(sampling.seed + k) % (MAX_SEED + 1)) for k in range(n)]


def raise_failure(states: list[RequestState]) -> None:
    failed = next((s for s in states if s.error), None)
    if failed is not None:
        raise GenerationFailed(failed.error, failed.error_status)


def generate_response(state: RequestState, logprobs_from: int = 0, input_logprobs_from: int = 0) -> dict:
    """One /generate item (the Engine and the RPC return the same)."""
    return {"text": state.text, "output_ids": list(state.output_ids),
            "meta_info": state.meta_info(logprobs_from, input_logprobs_from)}


def _repeat_n(values: list[Any], n: int) -> list[Any]:
    """n results per prompt, prompt-major."""
    return [v for v in values for _ in range(n)]


def _per_item(value: Any, count: int, batched: bool, what: str) -> list[Any]:
    if isinstance(value, list):
        if not batched or len(value) != count:
            raise InputError(f"'{what}' is a list of {len(value)} but the request has {count} prompt(s)")
        return value
    if what == "rid" and value is not None and batched:
        raise InputError("a batched request needs a list of rids")
    return [value] * count


class GenerateService:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    # ---- tokens ------------------------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        """A text prompt's tokens, as every generate route and /tokenize take them: the tokenizer's defaults (BOS)."""
        return self.runtime.tokenizer(text)["input_ids"]

    def tokenize_chat(self, messages: list[dict[str, Any]], options: ChatOptions = ChatOptions()) -> list[int]:
        """The prompt of a chat: its messages (and tools) through the chat template (frontend/chat_template.py)."""
        if not messages:
            raise InputError("'messages' is empty")
        text = render_chat(self.runtime.tokenizer, self.runtime.chat_template, messages, options)
        return self.runtime.tokenizer(text, add_special_tokens=False)["input_ids"]

    def detokenize(self, token_ids: list[int]) -> str:
        """Token ids as text, special tokens included (/detokenize, and an echoed prompt given as ids)."""
        return self.runtime.tokenizer.decode(token_ids, skip_special_tokens=False)

    async def resolve_model(self, model: str) -> tuple[str | None, str]:
        """An OpenAI `model` (base, adapter, or base:adapter): (adapter name or None for the base model, the name
        that serves it). An adapter the resolver or the host cache still has to bring in is loaded first."""
        runtime = self.runtime
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

    # ---- submit ------------------------------------------------------------------------------------------

    def take_rate(self, prompts: list[list[int]]) -> Callable[[], None]:
        """The caller's per-key rate limits for one API request of these prompts (RateLimited past them, taking
        nothing); returns the refund to call if the request is refused after all (frontend/rate_limits.py)."""
        limits, key_id = self.runtime.rate_limits, caller_key_id()
        num_prompt_tokens = sum(len(p) for p in prompts)
        limits.admit(key_id, 1, num_prompt_tokens)
        return lambda: limits.refund(key_id, 1, num_prompt_tokens)

    async def submit(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
                     stops: list[str], lora_names: list[str | None], rids: list[str | None],
                     output: OutputOptions = OutputOptions(), *, priority: int = 0) -> list[RequestState]:
        """Submit every prompt (with its own sampling when given a list), or none if one is refused."""
        runtime = self.runtime
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        batch = list(dict.fromkeys(name for name in lora_names if name is not None))  # distinct, in item order
        if batch and runtime.config.lora_enabled:
            runtime.adapters.check_batch(batch)
        states: list[RequestState] = []
        # Until every item holds its adapter, the batch's adapters are the last any other load may evict.
        runtime.registry.want(batch)
        try:
            # Check every adapter first so a bad name in a batch starts nothing; bringing one back evicts none of the
            # rest.
            for name in batch:
                if runtime.config.lora_enabled:
                    await runtime.adapters.ensure(name, batch)  # the resolver's first use, or an evicted host copy
                if runtime.registry.get(name) is None or runtime.registry.get(name).draining:
                    raise AdapterError(f"adapter {name!r} is not loaded", kind="not_found")
            for prompt, one_sampling, name, rid in zip(prompts, samplings, lora_names, rids, strict=False):
                states.append(await self._submit_one(prompt, one_sampling, stops, name, rid, output, priority))
        except BaseException:
            await self.finish(states)
            raise
        finally:
            runtime.registry.unwant(batch)
        return states

    async def start(self, body: NativeGenerateRequest) -> tuple[list[RequestState], bool]:
        """Validate and submit a /generate body (HTTP, Engine and RPC alike): (states, batched). With n > 1, n results
        per prompt in one flat list, prompt-major (always a list)."""
        runtime = self.runtime
        runtime.check_available()
        prompts, batched = self._prompts(body)
        params = body.sampling_params or NativeSamplingParams()
        refund = self.take_rate(_repeat_n(prompts, params.n))
        try:
            states = await self._start_checked(body, params, prompts, batched)
        except BaseException:
            refund()
            raise
        return states, batched or params.n > 1

    async def _start_checked(self, body: NativeGenerateRequest, params: NativeSamplingParams,
                             prompts: list[list[int]], batched: bool) -> list[RequestState]:
        runtime = self.runtime
        logprobs = body.top_logprobs_num if body.return_logprob else -1
        logprob_start_len = body.logprob_start_len if body.return_logprob else -1
        sampling, stops = native_sampling(params, runtime.eos_token_ids, logprobs, logprob_start_len,
                                          runtime.ready.vocab_size if runtime.ready else None)
        [sampling] = await constrain(runtime, [sampling], native_constraint(params))
        lora_names = _per_item(body.lora_path, len(prompts), batched, "lora_path")
        rids = _per_item(body.rid, len(prompts), batched, "rid")
        if params.n > 1:
            rids = [None if rid is None else f"{rid}-{k}" for rid in rids for k in range(params.n)]
            prompts, lora_names = _repeat_n(prompts, params.n), _repeat_n(lora_names, params.n)
        samplings = n_samplings(sampling, params.n) * (len(prompts) // params.n)
        output = OutputOptions(skip_special_tokens=params.skip_special_tokens, keep_stop=params.no_stop_trim)
        states = await self.submit(prompts, samplings, stops, lora_names, rids, output, priority=body.priority)
        for state in states:
            state.return_text_in_logprobs = body.return_text_in_logprobs
        return states

    def _prompts(self, body: NativeGenerateRequest) -> tuple[list[list[int]], bool]:
        """Prompts as token ids, and whether the request was batched."""
        if (body.text is None) == (body.input_ids is None):
            raise InputError("give exactly one of 'text' or 'input_ids'")
        if body.text is not None:
            texts = [body.text] if isinstance(body.text, str) else body.text
            if not texts:
                raise InputError("'text' is an empty list")
            return [self.tokenize(t) for t in texts], not isinstance(body.text, str)
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

    # ---- results -----------------------------------------------------------------------------------------

    async def stream(self, states: list[RequestState]) -> AsyncIterator[tuple[int, RequestState]]:
        """Yields (index, state) whenever any of the states changes, until all have finished."""
        if len(states) == 1:
            async for state in _changes(states[0]):
                yield 0, state
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, state: RequestState) -> None:
            async for s in _changes(state):
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

    async def wait(self, states: list[RequestState]) -> None:
        async for _ in self.stream(states):
            pass

    async def collect(self, states: list[RequestState], batched: bool) -> dict | list[dict]:
        """The /generate answer once every state finished; GenerationFailed if one failed."""
        await self.wait(states)
        raise_failure(states)
        outputs = [generate_response(s) for s in states]
        return outputs if batched else outputs[0]

    async def chunks(self, states: list[RequestState], batched: bool) -> AsyncIterator[dict]:
        """/generate's stream: each chunk carries what is new, an error body where a state failed."""
        sent = [0] * len(states)  # output tokens whose logprob entries went out already: a chunk carries its own
        sent_input = [0] * len(states)  # ... and prompt logprob entries
        async for index, state in self.stream(states):
            if state.error:
                chunk = msgspec.to_builtins(error_body(state.error, state.error_status))
            else:
                chunk = generate_response(state, sent[index], sent_input[index])
                sent[index] = len(state.output_logprobs)
                sent_input[index] = state.num_prompt_logprob_entries
            if batched:
                chunk["index"] = index
            yield chunk

    async def _submit_one(self, prompt_ids: list[int], sampling: SamplingParams, stop_strings: list[str],
                          lora_name: str | None, rid: str | None, output: OutputOptions,
                          priority: int) -> RequestState:
        """Check and enqueue one request. Raises InputError, AdapterError or ServerUnavailable."""
        runtime = self.runtime
        rid = rid or uuid.uuid4().hex
        if rid in runtime.requests:
            raise InputError(f"request id {rid!r} is already in use")
        self._check_fits(prompt_ids, sampling)
        if lora_name is not None:
            await runtime.adapters.ensure(lora_name)  # the guard: an eviction since the batch's ensure brings it back
        runtime.check_available()  # a process may have died, or a drain begun, while this request was prepared
        entry = runtime.registry.acquire(lora_name, rid) if lora_name is not None else None
        state = RequestState(
            rid, prompt_ids, sampling, stop_strings, runtime.tokenizer, lora_name, entry.lora_id if entry else None,
            output,
        )
        state.key_id = caller_key_id()
        state.dp_rank = runtime.router.pick(state.lora_id)
        runtime.router.acquire(state.dp_rank, state.lora_id)
        runtime.requests[rid] = state
        runtime.metrics.on_submit(len(prompt_ids))
        req = TokenizedGenerateReq(rid=rid, input_ids=prompt_ids, sampling=sampling, lora_id=state.lora_id,
                                   priority=priority, key_id=state.key_id)
        await runtime.replicas.send(state.dp_rank, req)
        return state

    def _check_fits(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        # The rule the scheduler checks again; max_total_tokens is the smallest replica's.
        ready = self.runtime.ready
        if error := request_fit_error(len(prompt_ids), sampling.max_new_tokens, ready.context_length,
                                      ready.max_total_tokens):
            raise InputError(error)
        vocab_size = ready.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_ids):
            raise InputError(f"input_ids must be token ids in [0, {vocab_size})")
        if any(not 0 <= t < vocab_size for t in sampling.stop_token_ids):
            raise InputError(f"stop_token_ids must be token ids in [0, {vocab_size})")
        if sampling.logprob_start_len >= len(prompt_ids):
            raise InputError(
                f"logprob_start_len ({sampling.logprob_start_len}) must be below the prompt length ({len(prompt_ids)})"
            )

    async def finish(self, states: list[RequestState]) -> None:
        """Every path of every request ends here (done, failed, client gone): frees what each state holds."""
        runtime = self.runtime
        for state in states:
            if runtime.requests.pop(state.rid, None) is None:
                continue
            was_finished = state.finished
            if not was_finished:
                state.fail("aborted by the client", status=499)
            # Counted before the hold goes: once released, an unload may drop the adapter's series.
            runtime.metrics.on_finish(state)
            runtime.rate_limits.charge_output(state.key_id, len(state.output_ids))
            runtime.router.release(state.dp_rank, state.lora_id)
            if state.lora_id is not None:
                runtime.registry.release(state.lora_id, state.rid)
            if not was_finished and runtime.failure is None and not runtime.stopping:
                await runtime.replicas.send(state.dp_rank, AbortReq(rid=state.rid))

    async def abort(self, rid: str) -> AbortReqOutput:
        state = self.runtime.requests.get(rid)
        if state is None:
            return AbortReqOutput(success=False, rid=rid, message=f"no request {rid!r} in flight")
        await self.runtime.replicas.send(state.dp_rank, AbortReq(rid=rid))
        return AbortReqOutput(success=True, rid=rid, message="")


async def _changes(state: RequestState) -> AsyncIterator[RequestState]:
    """Yields the state each time it changes, ending when it finishes."""
    while True:
        await state.changed.wait()
        state.changed.clear()
        yield state
        if state.finished:
            return
