"""GenerateService: generation without HTTP — submit (n results per prompt included), stream or collect, abort,
tokenize and detokenize, and the adapter operations the ways in offer.

Every way in calls it, one service per Runtime: the native, OpenAI and utility routes, the Engine, the RPC server and
the Ray replica (through its Engine). It says once whether the server is up (check_up), admits each request (the
edge's checks, the adapter's hold, the replica the router picks) into its table of requests in flight
(frontend/request_table.py), and is the one place every request leaves it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from loraplex.frontend.adapters.audit import SERVER, Caller
from loraplex.frontend.adapters.mixes import mix_error, parse_mix
from loraplex.frontend.adapters.registry import AdapterEntry, AdapterError
from loraplex.frontend.adapters.strength import item_scales
from loraplex.frontend.adapters.tokenizers import Vocabulary
from loraplex.frontend.bodies import error_body
from loraplex.frontend.caller import caller_key_id
from loraplex.frontend.chat_template import ChatOptions, render_chat
from loraplex.frontend.constraints import Found, native_constraint
from loraplex.frontend.errors import InputError, ServerUnavailable
from loraplex.frontend.multimodal.images import ImageSource
from loraplex.frontend.multimodal.prompt import PromptImages
from loraplex.frontend.multimodal.vision import no_images_error
from loraplex.frontend.params import MAX_SEED, LoRAMixBody, NativeGenerateRequest, NativeSamplingParams, native_sampling
from loraplex.frontend.request_state import OutputOptions, RequestState
from loraplex.frontend.request_table import RequestTable
from loraplex.frontend.runtime import Runtime
from loraplex.protocol.errors import ServerError
from loraplex.protocol.grammar import unavailable_message
from loraplex.protocol.request_limits import request_fit_error
from loraplex.protocol.structs import (
    AbortReqOutput,
    LoadLoRAAdapterFromTensorsReqInput,
    LoadLoRAAdapterReqOutput,
    LoRAAdapterSpec,
    SamplingParams,
    TokenizedGenerateReq,
    UnloadLoRAAdapterReqOutput,
)


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


def with_end_tokens(sampling: SamplingParams, vocabulary: Vocabulary) -> SamplingParams:
    """The sampling with the end tokens of its vocabulary's tokenizer among its stop tokens (an adapter's own may
    end on an added token); the base model's are there already (make_sampling)."""
    extra = [t for t in vocabulary.eos_token_ids if t not in sampling.stop_token_ids]
    if sampling.ignore_eos or not extra:
        return sampling
    return msgspec.structs.replace(sampling, stop_token_ids=[*sampling.stop_token_ids, *extra])


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


def _image_sources(image_data: Any, count: int, batched: bool) -> list[list[ImageSource]]:
    """image_data as each prompt's (what, source) list: one image or a list for one prompt; for a batch, one item
    (None, an image or a list) per prompt."""
    if image_data is None:
        return [[] for _ in range(count)]
    if not batched:
        if isinstance(image_data, str):
            return [[("image_data", image_data)]]
        if any(not isinstance(item, str) for item in image_data):
            raise InputError("'image_data' of one prompt must be an image (a string) or a list of images")
        return [[(f"image_data[{j}]", item) for j, item in enumerate(image_data)]]
    if not isinstance(image_data, list) or len(image_data) != count:
        raise InputError(f"'image_data' of a batch of {count} prompts must be a list of {count} items (an image, a "
                         "list of images, or null each)")  # fmt: skip
    return [[] if item is None else [(f"image_data[{k}]", item)] if isinstance(item, str)
            else [(f"image_data[{k}][{j}]", one) for j, one in enumerate(item)]
            for k, item in enumerate(image_data)]  # fmt: skip


class GenerateService:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.requests = RequestTable(runtime)
        runtime.attach(self.requests)

    def check_up(self) -> None:
        """ServerUnavailable (503) unless the server takes work: every operation of a way in starts here."""
        runtime = self.runtime
        if runtime.failure is not None:
            raise ServerUnavailable(f"server is unhealthy: {runtime.failure}")
        if runtime.stopping or runtime.draining:
            raise ServerUnavailable("server is shutting down")
        if runtime.ready is None:
            raise ServerUnavailable("server is starting")

    # ---- adapters ----------------------------------------------------------------------------------------

    async def constrain(self, samplings: list[SamplingParams], found: Found | None) -> list[SamplingParams]:
        """The samplings with the constraint attached, once it compiles (else an InputError-like 400 naming it; a 501
        where xgrammar cannot be imported, here or on a worker rank)."""
        if found is None:
            return samplings
        runtime = self.runtime
        worker_errors = [ready.grammar_error for ready in runtime.replica_ready if ready.grammar_error]
        if worker_errors:  # a rank of some replica cannot import xgrammar: it would refuse the batch
            raise ServerError(unavailable_message(worker_errors[0]), kind="unsupported")
        if any(not s.stop_token_ids for s in samplings):
            raise InputError(f"{found.field} needs a stop token to end the text: ignore_eos without stop_token_ids")
        await runtime.grammars.check(found.constraint, found.field, runtime.tokenizer, runtime.ready.vocab_size)
        return [msgspec.structs.replace(s, constraint=found.constraint) for s in samplings]

    async def load_adapters(self, specs: list[LoRAAdapterSpec], load_inplace: bool = False,
                            caller: Caller = SERVER) -> LoadLoRAAdapterReqOutput:
        self.check_up()
        return await self.runtime.adapters.load(specs, load_inplace, caller=caller)

    async def load_adapter_from_tensors(self, request: LoadLoRAAdapterFromTensorsReqInput, buffers: list,
                                        caller: Caller = SERVER) -> LoadLoRAAdapterReqOutput:
        self.check_up()
        return await self.runtime.adapters.load_from_tensors(request, buffers, caller)

    async def unload_adapters(self, names: list[str], caller: Caller = SERVER) -> UnloadLoRAAdapterReqOutput:
        self.check_up()
        return await self.runtime.adapters.unload(names, caller=caller)

    # ---- tokens ------------------------------------------------------------------------------------------

    def tokenizer(self) -> Any:
        """The tokenizer, once the server is up (/tokenizer_info)."""
        self.check_up()
        return self.runtime.tokenizer

    def vocabulary(self, lora_name: str | LoRAMixBody | None = None) -> Vocabulary:
        """What a request on this adapter is tokenized with: the adapter's own tokenizer when its directory carries
        one (frontend/adapters/tokenizers.py), else the base model's (the base model, a mix, any other adapter)."""
        return self._vocabulary_of(self.runtime.registry.get(lora_name) if isinstance(lora_name, str) else None)

    def _vocabulary_of(self, entry: AdapterEntry | None) -> Vocabulary:
        return entry.vocabulary if entry is not None and entry.vocabulary is not None else self.runtime.vocabulary

    async def request_vocabulary(self, lora_name: str | LoRAMixBody | None) -> Vocabulary:
        """vocabulary() for a request about to be encoded: an adapter the resolver has yet to bring in is loaded
        first, so that its own tokenizer encodes the prompt (its hold does the rest)."""
        runtime = self.runtime
        if isinstance(lora_name, str) and runtime.registry.get(lora_name) is None and runtime.config.lora_enabled:
            await runtime.adapters.find(lora_name)
        return self.vocabulary(lora_name)

    def tokenize(self, text: str, lora_name: str | LoRAMixBody | None = None) -> list[int]:
        """A text prompt's tokens, as every generate route and /tokenize take them: the tokenizer's defaults (BOS)."""
        self.check_up()
        return self.vocabulary(lora_name).tokenizer(text)["input_ids"]

    def tokenize_chat(self, messages: list[dict[str, Any]], options: ChatOptions = ChatOptions(),
                      lora_name: str | LoRAMixBody | None = None) -> list[int]:
        """The prompt of a chat: its messages (and tools) through the chat template (frontend/chat_template.py)."""
        self.check_up()
        if not messages:
            raise InputError("'messages' is empty")
        vocabulary = self.vocabulary(lora_name)
        text = render_chat(vocabulary.tokenizer, vocabulary.chat_template, messages, options)
        return vocabulary.tokenizer(text, add_special_tokens=False)["input_ids"]

    def check_images(self, count: int, what: str) -> None:
        """A prompt of `count` images, before any is read: a model without vision, or more than
        --limit-mm-per-prompt, is a 400."""
        if count:
            self.check_up()
            if self.runtime.images is None:
                raise no_images_error()
            self.runtime.images.check_count(count, what)

    async def prompt_images(self, input_ids: list[int], sources: list[ImageSource], what: str, *,
                            bare: bool = False) -> PromptImages:
        """A prompt's images read, checked and processed (frontend/multimodal/), each placeholder token of
        input_ids expanded to its image's run. bare: a source may be a path or raw base64 (image_data)."""
        self.check_images(len(sources), what)
        return await self.runtime.images.prompt(input_ids, sources, what, bare=bare)

    def detokenize(self, token_ids: list[int], lora_name: str | LoRAMixBody | None = None) -> str:
        """Token ids as text, special tokens included (an echoed prompt given as ids)."""
        return self.vocabulary(lora_name).tokenizer.decode(token_ids, skip_special_tokens=False)

    def detokenize_checked(self, token_ids: list[int], lora_name: str | None = None) -> str:
        """/detokenize: the ids checked against the vocabulary first."""
        self.check_up()
        vocab_size = self.runtime.ready.vocab_size
        if any(not 0 <= t < vocab_size for t in token_ids):
            raise InputError(f"tokens must be token ids in [0, {vocab_size})")
        return self.detokenize(token_ids, lora_name)

    async def resolve_model(self, model: str) -> tuple[str | None, str]:
        """An OpenAI `model` (base, adapter, or base:adapter): (adapter name or None for the base model, the name
        that serves it). An adapter the resolver or the host cache still has to bring in is loaded first."""
        self.check_up()
        base = self.runtime.config.model_name
        if model == base:
            return None, base
        name = model
        if ":" in model:
            prefix, name = model.split(":", 1)
            if prefix != base:
                raise AdapterError(f"The model `{model}` does not exist.", "not_found")
        if await self.runtime.adapters.find(name) is None:  # the resolver's first use loads it here
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
                     stops: list[str], lora_names: list[str | LoRAMixBody | None], rids: list[str | None],
                     output: OutputOptions = OutputOptions(), *, priority: int = 0,
                     lora_scales: list[float | None] | None = None, pooling: bool = False,
                     token_type_ids: list[list[int]] | None = None,
                     images: list[PromptImages | None] | None = None) -> list[RequestState]:
        """Submit every prompt (with its own sampling when given a list), or none if one is refused: every item is
        checked and holds its adapter before the first is sent. lora_names: each item's adapter, or a mix of
        adapters (a lora_mix object); lora_scales: each item's adapter strength. pooling: prefill-only requests of
        the pooling runner (frontend/pooling.py), whose states end with their pooled output; token_type_ids: each
        item's tokens' segments (an encoder's pairs), None: none. images: each item's images (prompt_images), whose
        expanded tokens its prompt is; None: none."""
        self.check_up()
        runtime = self.runtime
        self._check_runner(pooling)
        scales = item_scales(lora_scales or [None] * len(prompts), lora_names)
        lora_names = [await self._mix_name(item) if isinstance(item, LoRAMixBody) else item for item in lora_names]
        self._check_fixed_strength(lora_names, scales)
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        rids = [rid or uuid.uuid4().hex for rid in rids]
        for k, (prompt, one_sampling, rid) in enumerate(zip(prompts, samplings, rids, strict=False)):
            if rid in self.requests or rid in rids[:k]:
                raise InputError(f"request id {rid!r} is already in use")
            self._check_fits(prompt, one_sampling)
        entries = await self._hold_adapters(lora_names, rids)
        vocabularies = [self._vocabulary_of(entry) for entry in entries]  # the held adapter's, for its whole life
        states = [RequestState(rid, prompt, with_end_tokens(one_sampling, vocabulary), stops, vocabulary.tokenizer,
                               name, entry.lora_id if entry is not None else None, output)
                  for prompt, one_sampling, name, rid, entry, vocabulary in zip(
                      prompts, samplings, lora_names, rids, entries, vocabularies, strict=False)]
        key_id = caller_key_id()
        for state in states:  # no await since the holds: each state frees its own from here on (finish)
            state.key_id = key_id
            self.requests.add(state)
        try:
            types = token_type_ids or [[]] * len(states)
            for state, scale, item_types, mm in zip(states, scales, types, images or [None] * len(states),
                                                    strict=True):
                await runtime.replicas.send(state.dp_rank, TokenizedGenerateReq(
                    rid=state.rid, input_ids=state.prompt_ids, sampling=state.sampling, lora_id=state.lora_id,
                    lora_scale=scale, priority=priority, key_id=key_id, pooling=pooling, token_type_ids=item_types,
                    images=mm.images if mm else [], mrope_positions=mm.mrope_positions if mm else [],
                    mrope_delta=mm.mrope_delta if mm else 0))
        except BaseException:
            await self.finish(states)
            raise
        return states

    def _check_runner(self, pooling: bool) -> None:
        """A generation request on a pooling server, or the reverse: 400 naming the runner."""
        spec = self.runtime.pooling
        if spec is not None and not pooling:
            raise InputError(f"this server runs the pooling runner (--runner pooling, task {spec.task}): it does not "
                             "generate text; use /v1/embeddings, /pooling, /score, /rerank or /classify")
        if spec is None and pooling:
            raise InputError("this server runs the generate runner: embeddings, scores and classes need a server "
                             "started with --runner pooling (or --convert embed|classify, --is-embedding)")

    def _check_fixed_strength(self, lora_names: list[str | None], scales: list[float]) -> None:
        """A DoRA adapter's norms were computed at its own scale: lora_scale other than 1 is refused for it."""
        for name, scale in zip(lora_names, scales, strict=True):
            entry = self.runtime.registry.get(name) if name is not None and scale != 1.0 else None
            if entry is not None and entry.dora:
                raise ServerError(f"invalid_lora_scale: adapter {name!r} is a DoRA adapter, whose strength is fixed "
                                  f"(its weight norms are computed at its own scale); lora_scale must be 1",
                                  "invalid_lora_scale")  # fmt: skip

    async def _mix_name(self, raw: LoRAMixBody) -> str:
        """The adapter serving a lora_mix object (computed and loaded on its first use)."""
        if not self.runtime.config.lora_enabled:
            raise mix_error("LoRA is not enabled (start with --enable-lora)")
        return await self.runtime.adapters.mixes.resolve(parse_mix(msgspec.to_builtins(raw)))

    async def _hold_adapters(self, lora_names: list[str | None], rids: list[str]) -> list[AdapterEntry | None]:
        """Each item's hold on its adapter (one per item), then the server checked once more: a process may have
        died, or a drain begun, while they were taken. All or none."""
        batch = list(dict.fromkeys(name for name in lora_names if name is not None))  # distinct, in item order
        if not batch:
            self.check_up()
            return [None] * len(lora_names)
        adapters = self.runtime.adapters
        if self.runtime.config.lora_enabled:
            adapters.check_batch(batch)
        entries: list[AdapterEntry | None] = []
        # Until every item holds its adapter, the batch's adapters are the last any other load may evict; bringing
        # one back evicts none of the rest.
        self.runtime.registry.want(batch)
        try:
            for name, rid in zip(lora_names, rids, strict=False):
                entries.append(None if name is None else await adapters.hold(name, rid, batch))
            self.check_up()
        except BaseException:
            for entry, rid in zip(entries, rids, strict=False):
                if entry is not None:
                    adapters.release(entry.lora_id, rid)
            raise
        finally:
            self.runtime.registry.unwant(batch)
        return entries

    async def start(self, body: NativeGenerateRequest) -> tuple[list[RequestState], bool]:
        """Validate and submit a /generate body (HTTP, Engine and RPC alike): (states, batched). With n > 1, n results
        per prompt in one flat list, prompt-major (always a list)."""
        self.check_up()
        prompts, batched = await self._prompts(body)
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
        [sampling] = await self.constrain([sampling], native_constraint(params))
        lora_names = _per_item(body.lora_path, len(prompts), batched, "lora_path")
        lora_scales = _per_item(body.lora_scale, len(prompts), batched, "lora_scale")
        rids = _per_item(body.rid, len(prompts), batched, "rid")
        images = await self._native_images(body.image_data, prompts, batched)
        prompts = [mm.input_ids if mm else prompt for prompt, mm in zip(prompts, images, strict=True)]
        if params.n > 1:
            rids = [None if rid is None else f"{rid}-{k}" for rid in rids for k in range(params.n)]
            prompts, lora_names = _repeat_n(prompts, params.n), _repeat_n(lora_names, params.n)
            lora_scales = _repeat_n(lora_scales, params.n)
            images = _repeat_n(images, params.n)
        samplings = n_samplings(sampling, params.n) * (len(prompts) // params.n)
        output = OutputOptions(skip_special_tokens=params.skip_special_tokens, keep_stop=params.no_stop_trim)
        states = await self.submit(prompts, samplings, stops, lora_names, rids, output, priority=body.priority,
                                   lora_scales=lora_scales, images=images)
        for state in states:
            state.return_text_in_logprobs = body.return_text_in_logprobs
        return states

    async def _native_images(self, image_data: Any, prompts: list[list[int]],
                             batched: bool) -> list[PromptImages | None]:
        """Each prompt's images from /generate's image_data (every prompt's counted before any image is read)."""
        sources = _image_sources(image_data, len(prompts), batched)
        for k, item in enumerate(sources):
            self.check_images(len(item), f"image_data[{k}]" if batched else "image_data")
        return [await self.prompt_images(prompt, item, f"prompt {k}" if batched else "prompt", bare=True) if item
                else None for k, (prompt, item) in enumerate(zip(prompts, sources, strict=True))]  # fmt: skip

    async def _prompts(self, body: NativeGenerateRequest) -> tuple[list[list[int]], bool]:
        """Prompts as token ids (each text with its adapter's tokenizer), and whether the request was batched."""
        if (body.text is None) == (body.input_ids is None):
            raise InputError("give exactly one of 'text' or 'input_ids'")
        if body.text is not None:
            texts = [body.text] if isinstance(body.text, str) else body.text
            if not texts:
                raise InputError("'text' is an empty list")
            batched = not isinstance(body.text, str)
            lora_names = _per_item(body.lora_path, len(texts), batched, "lora_path")
            self.check_up()
            return [(await self.request_vocabulary(name)).tokenizer(text)["input_ids"]
                    for text, name in zip(texts, lora_names, strict=True)], batched  # fmt: skip
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
        await self.requests.finish(states)

    async def abort(self, rid: str) -> AbortReqOutput:
        return await self.requests.abort(rid)


async def _changes(state: RequestState) -> AsyncIterator[RequestState]:
    """Yields the state each time it changes, ending when it finishes."""
    while True:
        await state.changed.wait()
        state.changed.clear()
        yield state
        if state.finished:
            return
