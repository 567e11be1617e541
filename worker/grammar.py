"""Structured output on the worker: one xgrammar GrammarMatcher per constrained request, and the token mask it gives.

Only rank 0 holds matchers (it compiles each constraint once: xgrammar's compiler caches by source, bounded in
bytes, protocol/grammar.py). Every rank samples, so the ranks' unseeded generators stay in step; in a step with a
constrained row rank 0's tokens are then broadcast, and every rank feeds the same tokens to the next pass.

A matcher takes its request's last token lazily, at the next pass that includes the request: a pass with
num_generated = g must see a matcher that has accepted g tokens, and the token sampled at g - 1 is kept until then.
So a prompt chunk that samples nothing (its num_generated does not move), a token the scheduler drops (the request
ended in the older of two passes in flight) and a preempted request recomputed later all leave the matcher right:
it never accepts a token that is not in the request's output.

Where xgrammar cannot be imported, the rank says so in its ready message and the frontend refuses constrained
requests (501) before admission; a constrained batch that reaches the worker anyway is refused as a bad batch, on every
rank alike before the forward (BatchError), and the worker serves on.

A constraint with `start_after` (a reasoning model's `</think>` ids) leaves the request unmasked, its tokens unseen by
the matcher, until its output has ended with that sequence; the matcher starts from the token after.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from loraplex.protocol.grammar import compile_constraint, make_compiler, unavailable_message, xgrammar_import_error
from loraplex.protocol.structs import ForwardReq, SamplingParams
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.sampling_batch import SamplingBatch

logger = logging.getLogger(__name__)


@dataclass
class _Sequence:
    matcher: object  # xgrammar.GrammarMatcher
    num_accepted: int = 0
    pending_at: int = -1  # num_generated of the pass that sampled pending_token (-1: none)
    pending_token: int = -1
    is_broken: bool = False  # a sampled token broke the grammar (another mask left no allowed token): unmasked
    awaiting: tuple[int, ...] = ()  # the grammar starts once the output ends with these ids; () = it has started
    recent: list[int] = field(default_factory=list)  # the last len(awaiting) output tokens, while awaiting

    def watch(self, token: int) -> None:
        """A token sampled before the grammar started: it starts after this one if the awaited ids are complete."""
        self.recent = [*self.recent, token][-len(self.awaiting) :]
        if tuple(self.recent) == self.awaiting:
            self.awaiting, self.recent = (), []


def mask_backend(device: torch.device) -> str:
    """xgrammar's way to apply a bitmask to logits on `device`, chosen once. On CUDA its Triton kernel: the "cuda"
    backend compiles a CUDA kernel with nvcc on first use, inside a step on rank 0 (tens of seconds; under TP the
    other ranks would hit --dist-timeout), and a machine without nvcc cannot build it at all. Without Triton, its
    plain torch ops."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch_native"


class GrammarMasks:
    def __init__(self, model_dir: str, vocab_size: int, rank: int, world_size: int,
                 device: torch.device | None = None):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.rank, self.world_size = rank, world_size
        self.backend = mask_backend(device or torch.device("cpu"))
        # Why this rank cannot take constraints ("" it can), known at start-up for the ready message. Every rank asks,
        # so that a batch is refused on all ranks alike (the frontend refuses first when any rank cannot).
        self.import_error = xgrammar_import_error()
        self._compiler = None  # built on the first constrained request (it loads the tokenizer)
        self._sequences: dict[int, _Sequence] = {}  # req_key -> its matcher
        self._taken: dict[int, int] = {}  # req_key -> drafts its matcher took in this pass's mask_drafts

    def end(self, req_keys: list[int]) -> None:
        for req_key in req_keys:
            self._sequences.pop(req_key, None)

    def check(self, batch: SamplingBatch) -> None:
        """Before the forward: a constrained row where xgrammar cannot be imported fails the batch (the frontend
        refuses such requests first, from WorkerReady.grammar_error; this keeps a worker from dying on one)."""
        if batch.constrained_rows and self.import_error:
            raise BatchError(unavailable_message(self.import_error))

    def mask(self, logits: torch.Tensor, reqs: list[ForwardReq], batch: SamplingBatch) -> torch.Tensor:
        """logits (reqs, vocab) -> the same with every constrained row's forbidden tokens at -inf (a copy: the
        caller's logits stay raw, for logprobs); the logits themselves when no row is constrained, or off rank 0."""
        rows = [i for i in batch.constrained_rows if not reqs[i].num_draft_tokens]  # drafted rows: mask_drafts
        if not rows or self.rank != 0:
            return logits
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(reqs), self.vocab_size)  # (reqs, ceil(vocab / 32)) int32
        masked_rows = []
        for i in rows:
            seq = self._sequence(reqs[i], batch.params[i])
            # Terminated: its last token ended the request, and this row's token is dropped.
            if not seq.awaiting and not seq.is_broken and not seq.matcher.is_terminated():
                seq.matcher.fill_next_token_bitmask(bitmask, i)
                masked_rows.append(i)
        if not masked_rows:
            return logits
        masked = logits.clone()
        xgr.apply_token_bitmask_inplace(masked, bitmask.to(logits.device, non_blocking=True), indices=masked_rows,
                                        backend=self.backend)
        return masked

    def record(self, reqs: list[ForwardReq], batch: SamplingBatch, tokens: list[int]) -> list[int]:
        """After sampling: rank 0 keeps each constrained row's token for its matcher; with tensor parallelism every
        rank takes rank 0's tokens (the others sampled without the masks)."""
        if not batch.constrained_rows:
            return tokens
        if self.rank == 0:
            for i in batch.constrained_rows:
                if reqs[i].num_draft_tokens:  # record_drafts, once verified
                    continue
                seq = self._sequences[reqs[i].req_key]
                seq.pending_at, seq.pending_token = reqs[i].num_generated, tokens[i]
        if self.world_size > 1:
            shared = torch.tensor(tokens, dtype=torch.int64, device=self._collective_device())
            dist.broadcast(shared, src=0)
            tokens = shared.tolist()
        return tokens

    # ---- speculative decoding: a request's drafts verified under its grammar ------------------------------------

    def mask_drafts(self, logits: torch.Tensor, req: ForwardReq, params: SamplingParams) -> torch.Tensor:
        """logits (k + 1, vocab): a drafted request's verify rows, row j masked as the grammar stands after its first
        j drafts (a copy). The matcher takes the drafts in turn up to the first it refuses, where the mask forbids
        that draft, so acceptance ends there (later rows stay unmasked: no token of theirs is kept). record_drafts
        rolls the matcher back to the drafts accepted. Off rank 0: the logits as they are (rank 0's verdict is
        broadcast)."""
        if self.rank != 0:
            return logits
        import xgrammar as xgr

        seq = self._sequence(req, params)
        k = req.num_draft_tokens
        drafts = req.input_ids[-k:]
        bitmask = xgr.allocate_token_bitmask(k + 1, self.vocab_size)  # (k + 1, ceil(vocab / 32)) int32
        rows, num_taken = [], 0
        if not seq.is_broken:
            for j in range(k + 1):
                if seq.matcher.is_terminated():  # a draft ended the grammar: the request ends with it
                    break
                seq.matcher.fill_next_token_bitmask(bitmask, j)
                rows.append(j)
                if j == k or not seq.matcher.accept_token(drafts[j]):
                    break
                num_taken += 1
        self._taken[req.req_key] = num_taken
        if not rows:
            return logits
        masked = logits.clone()
        xgr.apply_token_bitmask_inplace(masked, bitmask.to(logits.device, non_blocking=True), indices=rows,
                                        backend=self.backend)  # fmt: skip
        return masked

    def record_drafts(self, reqs: list[ForwardReq], batch: SamplingBatch, tokens: list[int],
                      accepted_ids: list[list[int]]) -> None:  # fmt: skip
        """After verification, for the constrained rows with drafts: rank 0's matchers keep the accepted drafts and
        take the token after them lazily, as record's; with tensor parallelism every rank takes rank 0's verdict
        (tokens[i] and accepted_ids[i], in place), since only rank 0 masked."""
        rows = [i for i in batch.constrained_rows if reqs[i].num_draft_tokens]
        if not rows:
            return
        if self.rank == 0:
            for i in rows:
                seq, num_accepted = self._sequences[reqs[i].req_key], len(accepted_ids[i])
                num_taken = self._taken.pop(reqs[i].req_key)
                if num_taken > num_accepted:
                    seq.matcher.rollback(num_taken - num_accepted)
                seq.num_accepted += num_accepted
                seq.pending_at, seq.pending_token = seq.num_accepted, tokens[i]
        if self.world_size > 1:
            verdict = [v for i in rows for v in (tokens[i], len(accepted_ids[i]))]
            shared = torch.tensor(verdict, dtype=torch.int64, device=self._collective_device())
            dist.broadcast(shared, src=0)
            verdict = shared.tolist()
            for n, i in enumerate(rows):
                tokens[i], num_accepted = verdict[2 * n], verdict[2 * n + 1]
                accepted_ids[i] = reqs[i].input_ids[len(reqs[i].input_ids) - reqs[i].num_draft_tokens :][:num_accepted]

    def _sequence(self, req: ForwardReq, params: SamplingParams) -> _Sequence:
        """The request's matcher, having accepted exactly its num_generated output tokens. A count that disagrees
        is a bug in the sequencing (not a bad batch: only rank 0 sees it), so it raises and the worker exits."""
        seq = self._sequences.get(req.req_key)
        if seq is None:
            if req.num_generated != 0:
                raise RuntimeError(f"request {req.req_key} has {req.num_generated} output tokens but no grammar state")
            seq = _Sequence(matcher=self._matcher(params), awaiting=params.constraint.start_after)
            self._sequences[req.req_key] = seq
        if seq.num_accepted == req.num_generated - 1 and seq.pending_at == seq.num_accepted:
            if seq.awaiting:
                seq.watch(seq.pending_token)
            elif not seq.is_broken and not seq.matcher.accept_token(seq.pending_token):
                logger.error(
                    "request %d: token %d breaks its grammar; no longer masked", req.req_key, seq.pending_token
                )
                seq.is_broken = True
            seq.num_accepted += 1
        if seq.num_accepted != req.num_generated:
            raise RuntimeError(
                f"request {req.req_key}: its grammar took {seq.num_accepted} tokens, the pass has {req.num_generated}"
            )
        return seq

    def _matcher(self, params: SamplingParams) -> object:
        import xgrammar as xgr

        compiled = compile_constraint(self._compiler_for(), params.constraint)
        # The grammar may end only with one of the request's stop tokens (eos unless ignore_eos, plus its own), so
        # the scheduler ends the request with finish reason "stop" exactly when the grammar is complete.
        return xgr.GrammarMatcher(compiled, override_stop_tokens=list(params.stop_token_ids))

    def _compiler_for(self) -> object:
        if self._compiler is None:
            from transformers import AutoTokenizer

            start = time.perf_counter()
            self._compiler = make_compiler(AutoTokenizer.from_pretrained(self.model_dir), self.vocab_size)
            logger.info("grammar compiler ready in %.2f s", time.perf_counter() - start)
        return self._compiler

    def _collective_device(self) -> torch.device:
        is_nccl = dist.get_backend() == "nccl"
        return torch.device("cuda", torch.cuda.current_device()) if is_nccl else torch.device("cpu")
