"""Helpers shared by the worker tests (no tests here): a runner on CPU and a batch decoding loop."""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.mathutil import cdiv
from loraplex.protocol.sockets import PULL, PUSH, TypedSocket
from loraplex.protocol.structs import (
    Endpoints,
    ForwardBatch,
    ForwardReq,
    LoadAdapters,
    SamplingParams,
    SlotLoad,
    WorkerToScheduler,
)
from loraplex.worker.dist import destroy_distributed, init_distributed
from loraplex.worker.grammar import GrammarMasks
from loraplex.worker.model_runner import ModelRunner

from tests.net import free_port

PAGE_SIZE = 4
NUM_PAGES = 128
GREEDY = SamplingParams(temperature=0.0)
REPLY_TIMEOUT_MS = 20_000


TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
)


def build_llama_variant(out_dir: Path | str, **overrides) -> None:
    """A tiny Llama checkpoint with config overrides (rope scaling, head_dim, biases) the shared builder lacks.
    Every weight and bias is random and non-zero, so each one is observable in the outputs."""
    from transformers import AutoModelForCausalLM, LlamaConfig  # here: the TP test's ranks import this module

    config = LlamaConfig(**{**TINY_LLAMA, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            values = torch.randn(param.shape, generator=generator) * 0.3
            param.copy_(torch.ones_like(param) if name.endswith("norm.weight") else values)
    model.save_pretrained(out_dir, safe_serialization=True)


def make_runner(model_dir: Path | str, **config_kwargs) -> ModelRunner:
    config = ServerConfig(device="cpu", page_size=PAGE_SIZE, max_total_tokens=NUM_PAGES * PAGE_SIZE, **config_kwargs)
    return ModelRunner(config, str(model_dir), rank=0, world_size=1, device="cpu")


def consecutive_pages(lengths: list[int], page_size: int, first: int = 0) -> list[list[int]]:
    """Page tables for sequences of these lengths laid one after the other from page `first`."""
    pages, next_page = [], first
    for length in lengths:
        num_pages = -(-length // page_size)
        pages.append(list(range(next_page, next_page + num_pages)))
        next_page += num_pages
    return pages


def random_prompts(lengths: list[int], vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def decode(
    runner: ModelRunner,
    prompts: list[list[int]],
    params: list[SamplingParams],
    steps: int,
    slots: list[int] | None = None,
    slot_loads: list[SlotLoad] | None = None,
    resend_sampling: bool = False,
) -> list[list[int]]:
    """Prefill every prompt in one batch, then decode them together, each with its own sampling params (and adapter
    slot; slot_loads go with the first batch). Pages are handed out shuffled, so page tables are scattered. As the
    scheduler does, the params go with the first pass only (every pass with `resend_sampling`), and the requests'
    state is released at the end."""
    slots = slots or [-1] * len(prompts)
    free_pages = list(range(runner.kv_cache.num_pages))
    random.Random(0).shuffle(free_pages)
    pages = [[free_pages.pop() for _ in range(-(-(len(p) + steps) // runner.page_size))] for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in range(steps):
        reqs = [
            ForwardReq(
                input_ids=prompt if step == 0 else out[-1:],
                num_cached_tokens=0 if step == 0 else len(prompt) + step - 1,
                page_ids=page_ids,
                sampling=sampling if step == 0 or resend_sampling else None,
                num_generated=step,
                slot=slot,
                req_key=key,  # the worker keeps the request's params (and tokens, for penalties) under this key
            )
            for key, (prompt, page_ids, sampling, slot, out) in enumerate(
                zip(prompts, pages, params, slots, outputs, strict=True)
            )
        ]
        batch = ForwardBatch(batch_id=step, reqs=reqs, slot_loads=(slot_loads or []) if step == 0 else [])
        for out, token in zip(outputs, runner.forward(batch), strict=True):
            out.append(token)
    runner.forward(ForwardBatch(batch_id=steps, reqs=[], released_keys=list(range(len(prompts)))))
    return outputs


@contextmanager
def tp_group(config: ServerConfig, rank: int, port: int) -> Iterator[None]:
    """Inside a run_two_ranks child: this rank's gloo group on the loopback port, one thread (two ranks share the
    machine's cores), torn down on the way out."""
    torch.set_num_threads(1)
    init_distributed(config, f"127.0.0.1:{port}", rank, torch.device("cpu"))
    try:
        yield
    finally:
        destroy_distributed()


def run_two_ranks(target: Callable[..., None], *args: Any, timeout_s: float = 120.0) -> dict[int, Any]:
    """Run target(rank, port, *args, results) in two spawned processes (a gloo TP group on a free loopback port);
    each puts (rank, output) on results. Polls, so a rank that died is reported at once, and kills what is left."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, port, *args, results), daemon=True) for rank in (0, 1)]
    try:
        for p in procs:
            p.start()
        by_rank: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(by_rank) < len(procs):
            crashed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not crashed, f"a TP rank exited with {crashed}"
            assert time.monotonic() < deadline, f"TP ranks gave no result in {timeout_s}s"
            try:
                rank, out = results.get(timeout=1)
            except queue.Empty:
                continue
            by_rank[rank] = out
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        return by_rank
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class FakeScheduler:
    """The scheduler's end of the worker sockets (batches, drops and the loaders'), for tests that run worker
    processes without one."""

    def __init__(self, endpoints: Endpoints):
        self.from_workers = TypedSocket(PULL, endpoints.workers_to_scheduler, bind=True, recv_type=WorkerToScheduler)
        self.to_workers = [TypedSocket(PUSH, addr, bind=False) for addr in endpoints.scheduler_to_workers]
        self.to_loaders = [TypedSocket(PUSH, addr, bind=False) for addr in endpoints.scheduler_to_loaders]

    def send(self, msg) -> None:  # every rank gets every message, as from the real scheduler
        for sock in self.to_workers:
            sock.send(msg)

    def load(self, op: LoadAdapters) -> None:  # to every rank's loader socket, as the real scheduler does
        for sock in self.to_loaders:
            sock.send(op)

    def recv(self, timeout_ms: int = REPLY_TIMEOUT_MS):
        msg = self.from_workers.recv(timeout_ms=timeout_ms)
        assert msg is not None, "no reply from the workers"
        return msg

    def close(self) -> None:
        self.from_workers.close()
        for sock in [*self.to_workers, *self.to_loaders]:
            sock.close()


@torch.inference_mode()
def forward_logits(runner: ModelRunner, batch: ForwardBatch) -> torch.Tensor:
    """(tokens, vocab) logits of every new token of the batch, in request order."""
    return runner.logits(batch.reqs, batch.slot_loads, last_only=False)


@torch.inference_mode()
def prefill_logits(runner: ModelRunner, input_ids: list[int], slot: int = -1) -> torch.Tensor:
    """(tokens, vocab) logits of one sequence from an empty cache. Overwrites the first pages."""
    num_pages = cdiv(len(input_ids), runner.page_size)
    req = ForwardReq(
        input_ids=input_ids, num_cached_tokens=0, page_ids=list(range(num_pages)), sampling=SamplingParams(), slot=slot
    )
    return runner.logits([req], [], last_only=False)


def chunked_prefill_after_a_prefix(
    runner: ModelRunner, slot: int, slot_loads: list[SlotLoad]
) -> tuple[list[int], int, torch.Tensor]:
    """As the scheduler runs the prefix cache and chunked prefill: request A fills pages; request B (same slot, same
    first two pages) reuses them as cached and prefills the rest in chunks of 5. Returns B's prompt, the number of
    cached tokens and the chunks' (new tokens, vocab) logits."""
    page = runner.page_size
    prefix = random_prompts([2 * page], runner.vocab_size, seed=43)[0]
    prompt_a = prefix + random_prompts([3], runner.vocab_size, seed=44)[0]
    prompt_b = prefix + random_prompts([11], runner.vocab_size, seed=45)[0]
    pages_a, pages_b = [60, 61, 62], [60, 61, 70, 71, 72]  # B shares A's two prefix pages
    req_a = ForwardReq(input_ids=prompt_a, num_cached_tokens=0, page_ids=pages_a, sampling=GREEDY, slot=slot)
    runner.forward(ForwardBatch(batch_id=0, reqs=[req_a], slot_loads=slot_loads))
    chunks, num_cached = [], len(prefix)
    while num_cached < len(prompt_b):
        chunk = prompt_b[num_cached : num_cached + 5]
        req = ForwardReq(input_ids=chunk, num_cached_tokens=num_cached, page_ids=pages_b, sampling=GREEDY, slot=slot)
        chunks.append(forward_logits(runner, ForwardBatch(batch_id=1, reqs=[req])))
        num_cached += len(chunk)
    assert len(chunks) == 3
    return prompt_b, len(prefix), torch.cat(chunks)


def num_grammar_sequences(grammar: GrammarMasks) -> int:
    """The requests whose grammar state the worker still holds."""
    return len(grammar._sequences)


@dataclass
class Seq:
    prompt: list[int]
    prefill_chunk: int  # prompt tokens per step while prefilling
    page_ids: list[int] = field(default_factory=list)  # a prefix-cache hit starts with another's first pages
    num_cached: int = 0  # and their tokens counted here
    output: list[int] = field(default_factory=list)
    slot: int = -1  # its adapter's slot
    state_slot: int = -1  # hybrid models: its state slot

    def next_input(self) -> list[int]:
        if self.num_cached < len(self.prompt):
            return self.prompt[self.num_cached : self.num_cached + self.prefill_chunk]
        return self.output[-1:]


def run_greedy_schedule(
    runner: ModelRunner, seqs: list[Seq], start_steps: list[int], max_new_tokens: int, seed: int = 0,
    slot_loads: list[SlotLoad] | None = None,
) -> list[list[int]]:
    """A miniature scheduler: scattered pages handed out as sequences grow, requests joining mid-run (slot_loads
    go with the first batch)."""
    used = {page for s in seqs for page in s.page_ids}
    free_pages = [page for page in range(NUM_PAGES) if page not in used]
    random.Random(seed).shuffle(free_pages)
    step = 0
    while any(len(s.output) < max_new_tokens for s in seqs):
        active = [
            s for s, start in zip(seqs, start_steps, strict=True) if start <= step and len(s.output) < max_new_tokens
        ]
        reqs = []
        for s in active:
            input_ids = s.next_input()
            while len(s.page_ids) * PAGE_SIZE < s.num_cached + len(input_ids):
                s.page_ids.append(free_pages.pop())
            reqs.append(
                ForwardReq(
                    input_ids=input_ids, num_cached_tokens=s.num_cached, page_ids=list(s.page_ids), sampling=GREEDY,
                    slot=s.slot, state_slot=s.state_slot,
                )
            )
        loads = (slot_loads or []) if step == 0 else []
        next_tokens = runner.forward(ForwardBatch(batch_id=step, reqs=reqs, slot_loads=loads))
        for s, req, token in zip(active, reqs, next_tokens, strict=True):
            s.num_cached += len(req.input_ids)
            if s.num_cached >= len(s.prompt):  # a token sampled mid-prompt (chunked prefill) is discarded
                s.output.append(token)
        step += 1
    return [s.output for s in seqs]
