"""Scheduler: the state machine of the scheduler process, free of sockets so tests drive it directly.

One step: schedule() -> ForwardBatch -> the workers run it -> process_result(BatchResult) -> TokenDeltas.
Requests, aborts and adapter ops arrive between steps.

A step: every decoding request writes one token; requests still prefilling take their next chunk, then waiting ones
their first, under the step's prefill token budget (--chunked-prefill-size; -1: whole prompts up to
--max-prefill-tokens, a longer one alone). A request holds pages only for the tokens it has; when a step's requests
need more pages than are free (after evicting unused cached pages), the newest running requests are preempted (the
lowest priority's first under --scheduling-policy priority): their pages go back, they rejoin the queue, and are
recomputed when they run again (sampling is stateless given the seed and the output count, so their outputs are the
same). Full pages whose keys and values are written
are offered to the prefix cache, keyed by adapter; a new request starts from the longest cached prefix it matches.
Longrope models (Phi-3, Phi-4-mini): a request longer than the original length takes the long factors at every
position, as transformers does; one that grows past it is recomputed so (a preemption), and such requests neither
match nor offer cached pages, which hold short-factor KV.
When every layer of the model attends only within a sliding window (`attention_window`, from the workers' ready
report), a request gives back its pages wholly behind the window of its next query, as soon as their tokens are
written (a cached one stays cached, unused by it); its page table keeps FREED_PAGE in their place.

Hybrid models (linear-attention layers beside attention; WorkerReady.num_state_slots > 0): a running request also
holds a state slot, taken at admission with its first pages and given back with them (finish, abort, preemption).
The workers keep its layers' recurrent and conv states there; a pass from position 0 starts them from zero, so a
preempted request rebuilds its state when it is recomputed. Such a state exists only at a request's current
position, so the prefix cache keeps state snapshots (WorkerReady.num_state_snapshots) at cached page boundaries
(prefix_cache.py): a hit reaches only to the deepest matched page with one, and its first pass restores it into the
request's slot. An admitted request saves its states, in the pass that crosses each, at two boundaries: its
prompt's last full page (a later turn of the conversation starts there) and, where the KV cache matched deeper than
any snapshot, the deepest matched page (the next request sharing that system prompt hits it). A save's snapshot is
attached to its page only when its pass returns, so no pass restores a snapshot still being written.

Overlap: up to two passes are in flight, so the workers start the next one the moment they finish one, and this
process schedules and processes results meanwhile. A decoding request in the newer pass reads the token the older
pass samples for it, which no one here knows yet: its ForwardReq names that token's row in the older pass
(`prev_row`) and the workers put it in. A request that a stop token ends in the older pass is also in the newer one;
that pass's token is dropped, and its pages and slot are held until that pass returns. Preemption and adapter drops
wait until nothing is in flight.

Speculative decoding (--speculative-config): a decoding request whose sampling the workers verify exactly
(SamplingParams.allows_drafts) and that has no pass in flight (its last token must be known to draft from) takes up
to k draft tokens, never past its max_new_tokens: from NgramProposer (method ngram), or, with method draft_model,
the workers' draft model proposes them (the pass names how many). Its pass writes the last token and the drafts
(pages for all of them), and the workers return the drafts they accepted and one token more. When it returns,
the rejected drafts' positions and any page past the accepted ones go back, so the request holds exactly the pages
of its written tokens, as without speculation. Such a request sits out the pass after its own while that one is in
flight (no overlap for it). A request whose verify pass accepts nothing, or that has nothing to draft, backs off:
after m such passes in a row it decodes min(2^m, MAX_PASSES_WITHOUT_DRAFTS) passes without drafts (and with the
overlap), so open generation that no draft predicts runs almost as without speculation. Hybrid models
(linear-attention state cannot be rolled back) and longrope models (a draft may cross the original length) decode
without drafts. Draft and accepted counts are kept per adapter.

Request state on the workers: a request's first pass after each admission carries its sampling parameters (a
grammar's whole text included), and its cached tokens when penalties read them; every rank keeps them under the
request's `req_key` (its arrival number), so later passes carry neither. Rank 0 also keeps a grammar matcher for a
constrained request (the scheduler carries its constraint without reading it). The batch after the request ends names
its key in `released_keys`, and the workers free it all; a preempted request keeps its state there.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.request_limits import request_fit_error
from loraplex.protocol.speculative import SpeculativeConfig
from loraplex.protocol.structs import (
    AdapterOpDone,
    AdapterOutcome,
    AdapterReport,
    BatchResult,
    DropAdapters,
    ForwardBatch,
    ForwardReq,
    LoadAdapters,
    SchedulerStats,
    SlotLoad,
    SpecCount,
    TokenDelta,
    TokenizedGenerateReq,
    TokenLogprob,
)
from loraplex.scheduler.adapter_table import AdapterTable, LoadFinished
from loraplex.scheduler.admission_order import AdmissionOrder
from loraplex.scheduler.batch_policy import BatchPolicy
from loraplex.scheduler.image_runs import whole_image_len
from loraplex.scheduler.ngram_proposer import NgramProposer
from loraplex.scheduler.page_allocator import PageAllocator
from loraplex.scheduler.prefix_cache import BASE_NAMESPACE, PrefixCache, page_keys
from loraplex.scheduler.request import FREED_PAGE, Request, RequestStatus, image_error
from loraplex.scheduler.slot_planner import SlotError, SlotPlanner
from loraplex.scheduler.state_slots import StateSlotAllocator

log = logging.getLogger(__name__)


MAX_IN_FLIGHT = 2  # the workers compute one pass while the next waits in their socket
# Speculative decoding: after m verify passes in a row that accepted nothing, a request decodes min(2^m, this) passes
# without drafts before it drafts again, so open generation that no draft predicts runs as without speculation.
MAX_PASSES_WITHOUT_DRAFTS = 32


@dataclass
class _InFlight:
    batch_id: int
    reqs: list[Request]  # in the order of the batch's ForwardReqs
    num_new: list[int]  # tokens each request writes in this pass
    samples: list[bool]  # whether the pass samples a token for the request (it reaches its last known token)
    saves: list[list[tuple[int, int]]]  # hybrid models: the (position, snapshot) states each request saves
    num_drafts: list[int]  # speculative decoding: draft tokens each request verifies (among its num_new)


class Scheduler:
    def __init__(
        self,
        config: ServerConfig,
        *,
        num_pages: int,
        context_length: int,
        num_ranks: int = 1,
        chunked_prefill_size: int = 512,
        long_rope_len: int = 0,
        attention_window: int | None = None,
        num_state_slots: int = 0,
        num_state_snapshots: int = 0,
        pools_whole_prompt: bool = False,
        images_whole: bool = False,
    ):
        """attention_window: the most tokens a query of any layer attends to (its own included); None = some layer
        attends to the whole context, and no page is given back before its request ends. pools_whole_prompt
        (PoolingSpec.whole_prompt): a pooling request's prompt runs in one pass from position 0, neither chunked nor
        matched or offered to the prefix cache (mean or first-token pooling reads every token's state; a
        bidirectional model's states depend on the tokens after them). images_whole (WorkerReady.images_whole): a
        chunk of a prompt never ends inside an image's placeholder run (its tokens attend to each other both ways:
        Gemma 3, Gemma 4 with use_bidirectional_attention "vision")."""
        self.config = config
        self.images_whole = images_whole
        self.attention_window = attention_window
        self.pools_whole_prompt = pools_whole_prompt
        self.page_size = config.page_size
        self.context_length = context_length
        self.long_rope_len = long_rope_len  # WorkerReady.long_rope_len: 0 = none
        self.pages = PageAllocator(num_pages)
        self.state_slots = StateSlotAllocator(num_state_slots)
        self.is_hybrid = num_state_slots > 0
        self.snapshots = StateSlotAllocator(num_state_snapshots, kind="state snapshot")
        caches = config.prefix_caching and (num_state_snapshots > 0 or not self.is_hybrid)
        if self.is_hybrid and config.prefix_caching:
            if caches:
                log.info("prefix caching with %d state snapshots: a hit restores the linear-attention states saved "
                         "at its last page", num_state_snapshots)  # fmt: skip
            else:
                log.info("prefix caching is off: no state snapshots (--max-state-snapshots 0) to restore this hybrid "
                         "model's linear-attention states at a cached prefix")  # fmt: skip
        self.cache = PrefixCache(self.pages, config.page_size, enabled=caches,
                                 snapshots=self.snapshots if self.is_hybrid else None)  # fmt: skip
        self.slots = SlotPlanner(config.max_loras_per_batch)
        self.adapters = AdapterTable(num_ranks, config.lora_load_timeout)
        self.policy = BatchPolicy(max_running_requests=config.max_running_requests,
                                  max_running_per_adapter=config.max_running_per_adapter)
        self.order = AdmissionOrder(by_priority=config.scheduling_policy == "priority",
                                    is_fair=not config.disable_adapter_fairness)
        # The step's prefill token budget; chunked: prompts are cut to fit it, else whole (a longer one alone).
        self.is_chunked = chunked_prefill_size > 0
        self.prefill_budget = chunked_prefill_size if self.is_chunked else config.max_prefill_tokens
        self.waiting: dict[str, Request] = {}  # offered for admission in AdmissionOrder's order
        self.running: dict[str, Request] = {}
        self.num_preemptions = 0
        self._in_flight: deque[_InFlight] = deque()  # oldest first
        self._next_batch_id = 0
        self._next_arrival = 0
        self._plan: dict[Request, int] = {}  # the step being built: request -> tokens it writes
        self._released_keys: list[int] = []  # ended requests whose state the workers keep, told with the next batch
        self._budget_left = 0
        spec = self._speculation(config, num_state_slots, long_rope_len)
        is_ngram = spec is not None and spec.method == "ngram"
        self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max,
                                      spec.num_speculative_tokens) if is_ngram else None  # fmt: skip
        # method draft_model: the workers' draft model proposes this many tokens a pass (the scheduler plans pages)
        self.num_model_drafts = spec.num_speculative_tokens if spec is not None and not is_ngram else 0
        # the step being built: request -> its draft count, and its n-gram draft tokens (a draft model's are the
        # workers' to propose)
        self._num_drafts: dict[Request, int] = {}
        self._drafts: dict[Request, list[int]] = {}
        self.spec_counts: dict[int | None, list[int]] = {}  # lora_id -> [drafted, accepted, verify passes]

    @staticmethod
    def _speculation(config: ServerConfig, num_state_slots: int, long_rope_len: int) -> SpeculativeConfig | None:
        spec = config.speculation
        if spec is None:
            return None
        if num_state_slots:
            log.warning("speculative decoding is off: this hybrid model's linear-attention states cannot be rolled "
                        "back past rejected drafts")  # fmt: skip
            return None
        if long_rope_len:
            log.warning("speculative decoding is off: a draft may cross this longrope model's original length")
            return None
        log.info("speculative decoding: %s, up to %d draft tokens a pass", spec.method, spec.num_speculative_tokens)
        return spec

    @property
    def is_idle(self) -> bool:
        return not self.waiting and not self.running

    @property
    def has_batch_in_flight(self) -> bool:
        return bool(self._in_flight)

    @property
    def can_schedule(self) -> bool:
        return len(self._in_flight) < MAX_IN_FLIGHT

    @property
    def oldest_batch_id(self) -> int:
        return self._in_flight[0].batch_id

    def is_in_flight(self, batch_id: int) -> bool:
        return any(b.batch_id == batch_id for b in self._in_flight)

    @property
    def max_total_tokens(self) -> int:
        return self.pages.num_pages * self.page_size

    # ---- requests ----------------------------------------------------------------------------------------

    def add_request(self, req: TokenizedGenerateReq) -> list[TokenDelta]:
        error = self._refusal(req)
        if error:
            return [TokenDelta(rid=req.rid, token_ids=[], finish_reason="error", error_message=error)]
        if req.sampling.max_new_tokens == 0 and req.sampling.logprob_start_len < 0 and not req.pooling:
            return [TokenDelta(rid=req.rid, token_ids=[], finish_reason="length")]
        self.waiting[req.rid] = Request.from_req(req, self._next_arrival)
        self.order.on_wait(self.waiting[req.rid])
        self._next_arrival += 1
        return []

    def _refusal(self, req: TokenizedGenerateReq) -> str:
        """Why the request can never run, or "" when it can (perhaps after waiting)."""
        if req.rid in self.waiting or req.rid in self.running:
            return f"request id {req.rid!r} is already in progress"
        if req.lora_id is not None and not self.adapters.is_loaded(req.lora_id):
            return f"adapter {req.lora_id} not loaded"
        if req.token_type_ids and (len(req.token_type_ids) != len(req.input_ids) or not req.pooling):
            return f"{len(req.token_type_ids)} token types for {len(req.input_ids)} prompt tokens (a pooling request's)"
        if error := image_error(req):
            return error
        # The frontend refuses these at the edge; checked again so that no sender can make the scheduler fail.
        return request_fit_error(len(req.input_ids), req.sampling.max_new_tokens, self.context_length,
                                 self.max_total_tokens)

    def abort(self, rid: str) -> list[TokenDelta]:
        """Waiting: removed now. Running: freed now, or when its passes in flight return. Unknown rid: ignored."""
        req = self.waiting.get(rid) or self.running.get(rid)
        if req is None or req.is_aborted:
            return []
        if req.num_passes_in_flight:
            req.is_aborted = True  # the workers are using its pages: it ends when its last pass returns
            return []
        return [self._finish(req, "abort")]

    def _finish(
        self,
        req: Request,
        reason: str,
        token_ids: list[int] | None = None,
        error_message: str = "",
        logprobs: list[TokenLogprob] | None = None,
    ) -> TokenDelta:
        """Every way a request ends comes through here: its pages and slot hold go back (once no pass uses them)."""
        if req.status is RequestStatus.RUNNING:
            if not req.num_passes_in_flight:
                self._let_go(req)
            del self.running[req.rid]
        elif req.status is RequestStatus.WAITING:
            del self.waiting[req.rid]
            self.order.on_leave(req)
        req.status = RequestStatus.FINISHED
        if req.is_on_workers:
            self._released_keys.append(req.arrival)  # its sampling parameters, penalty history, grammar matcher
        return self._delta(req, token_ids or [], finish_reason=reason, error_message=error_message,
                           logprobs=logprobs or [])

    def _delta(self, req: Request, token_ids: list[int], **fields: Any) -> TokenDelta:
        """A delta of req's; the first it sends carries its prefix cache hit, so the count crosses once."""
        num_cached, req.num_hit_tokens_to_send = req.num_hit_tokens_to_send, 0
        return TokenDelta(rid=req.rid, token_ids=token_ids, num_cached_prompt_tokens=num_cached, **fields)

    # ---- one step ------------------------------------------------------------------------------------------

    def schedule(self) -> ForwardBatch | None:
        if not self.can_schedule:
            raise RuntimeError(f"schedule() called with {len(self._in_flight)} batches in flight")
        self._plan, self._num_drafts, self._drafts, self._budget_left = {}, {}, {}, self.prefill_budget
        for req in sorted(self.running.values(), key=lambda r: r.arrival):
            if req.is_aborted or not req.wants_more:
                continue  # it ends when its passes in flight return
            if req.num_passes_in_flight and req.num_unscheduled_tokens <= 1 and self._drafts_now(req):
                continue  # it drafts from its last token, which a pass in flight is still sampling
            if req.is_long_rope != self._needs_long_rope(req):
                # It grew past longrope's original length: as transformers does, every position takes the long
                # factors from now on, so its KV is recomputed (once the passes that write it have returned).
                if not req.num_passes_in_flight:
                    self._preempt(req)
                continue
            num_new = 1 if req.num_unscheduled_tokens == 1 else self._prefill_len(req)
            is_decoding = req.num_unscheduled_tokens == 1 and req.num_scheduled_tokens >= len(req.prompt_ids)
            if num_new == 1 and is_decoding and req.num_passes_without_drafts:
                req.num_passes_without_drafts -= 1
            elif num_new == 1 and is_decoding and self._drafts_for(req):
                if self.proposer is not None:
                    self._drafts[req] = self.proposer.propose(req.token_ids, req.num_remaining_tokens - 1)
                    self._num_drafts[req] = len(self._drafts[req])
                else:  # the workers' draft model proposes them: the scheduler knows only how many
                    self._num_drafts[req] = min(self.num_model_drafts, req.num_remaining_tokens - 1)
                num_new += self._num_drafts[req]
                if not self._num_drafts[req]:  # nothing to draft: back off as from a miss
                    self._count_miss(req)
            if num_new:
                self._plan[req] = num_new
        if not self._grow_running():
            self._plan, self._num_drafts, self._drafts = {}, {}, {}
            return None  # it needs a preemption: after the passes in flight return
        waiting = self.order.order(self.waiting.values())
        admitted = self.policy.pick_prefills(waiting, list(self.running.values()), self.slots, self)
        for req in admitted:
            del self.waiting[req.rid]
            self.order.on_admit(req)
            req.status = RequestStatus.RUNNING
            self.running[req.rid] = req
        # Adapters already resident take their holds first, so that placing a new one never evicts them.
        slot_loads = []
        for req in sorted(admitted, key=lambda r: r.lora_id is not None and not self.slots.is_resident(r.lora_id)):
            if req.lora_id is not None:
                req.slot, is_new = self.slots.assign(req.lora_id)
                if is_new:
                    slot_loads.append(SlotLoad(slot=req.slot, lora_id=req.lora_id))
        if not self._plan:
            return None
        # Grouped by slot, so each adapter's rows form one segment: one LoRA matmul per adapter, not per request.
        reqs = sorted(self._plan, key=lambda r: r.slot)
        num_new = [self._plan[r] for r in reqs]
        previous = self._in_flight[-1] if self._in_flight else None
        prev_rows = {req: row for row, req in enumerate(previous.reqs)} if previous else {}
        forward_reqs, samples, saves = [], [], []
        num_drafts = [self._num_drafts.get(r, 0) for r in reqs]
        for req, n, k in zip(reqs, num_new, num_drafts, strict=True):
            saves.append(self._snapshot_saves(req, n))
            forward_reqs.append(self._forward_req(req, n, prev_rows.get(req, -1), saves[-1], k))
            req.num_scheduled_tokens += n
            req.num_passes_in_flight += 1
            samples.append(req.num_unscheduled_tokens + k == 0)  # its drafts are scheduled, not yet its tokens
            req.num_pending_samples += samples[-1]
        batch = ForwardBatch(batch_id=self._next_batch_id, reqs=forward_reqs, slot_loads=slot_loads,
                             released_keys=self._released_keys)
        self._released_keys = []
        self._next_batch_id += 1
        self._in_flight.append(_InFlight(batch_id=batch.batch_id, reqs=reqs, num_new=num_new, samples=samples,
                                         saves=saves, num_drafts=num_drafts))  # fmt: skip
        return batch

    def _drafts_for(self, req: Request) -> bool:
        """Whether speculative decoding drafts for the request (its decoding passes)."""
        return (self.proposer is not None or self.num_model_drafts > 0) and req.sampling.allows_drafts

    def _drafts_now(self, req: Request) -> bool:
        """... and its next decoding pass is one that drafts (not backing off)."""
        return self._drafts_for(req) and not req.num_passes_without_drafts

    def _prefill_len(self, req: Request) -> int:
        """Prompt tokens the request writes this step within the budget left (0: none this step); takes them."""
        remaining = req.num_unscheduled_tokens
        if self.is_chunked and not self._is_whole(req):
            num_new = min(remaining, self._budget_left)
            if self.images_whole and req.images:
                num_new = whole_image_len(req.images, req.num_scheduled_tokens, num_new,
                                          alone=self._budget_left == self.prefill_budget)  # fmt: skip
        elif remaining <= self._budget_left or self._budget_left == self.prefill_budget:
            num_new = remaining  # whole prompts; one longer than the budget runs alone
        else:
            num_new = 0
        self._budget_left = max(0, self._budget_left - num_new)
        return num_new

    def _pages_short(self, req: Request, num_new: int) -> int:
        return req.num_pages_for(req.num_scheduled_tokens + num_new, self.page_size) - len(req.page_ids)

    def _grow_running(self) -> bool:
        """Pages for the running requests' new tokens; while they do not fit, preempt the newest. False: that needs
        a preemption while passes are in flight (they use the pages), so nothing was done."""
        while sum(self._pages_short(r, n) for r, n in self._plan.items()) > self.cache.num_available:
            if self._in_flight:
                return False
            victim = self.order.victim(self.running.values())
            self._preempt(victim)
        for req, num_new in self._plan.items():
            req.page_ids += self.cache.allocate(self._pages_short(req, num_new))
        return True

    def _preempt(self, req: Request) -> None:
        self._let_go(req)
        self._plan.pop(req, None)
        self._num_drafts.pop(req, None)
        self._drafts.pop(req, None)
        del self.running[req.rid]
        req.num_cached_tokens = req.num_scheduled_tokens = req.num_offered_pages = 0
        req.restore_snapshot, req.snapshot_positions = -1, []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting[req.rid] = req  # back in the queue by its arrival (AdmissionOrder)
        self.order.on_wait(req)

    def _let_go(self, req: Request) -> None:
        """A running request gives back its pages (cached ones stay cached) and its slot hold."""
        self.cache.release(req.live_page_ids)
        req.page_ids, req.num_freed_pages = [], 0
        if req.state_slot != -1:
            self.state_slots.free(req.state_slot)
            req.state_slot = -1
        if req.lora_id is not None:
            self.slots.release(req.lora_id)

    # ---- Admission (BatchPolicy asks) ------------------------------------------------------------------------

    def _needs_long_rope(self, req: Request) -> bool:
        """Whether its sequence after the next pass (the whole prompt for a prefill, as transformers encodes it)
        is longer than longrope's original length."""
        return 0 < self.long_rope_len < req.num_tokens + req.num_pending_samples

    def _is_whole(self, req: Request) -> bool:
        """A pooling request whose prompt runs whole, from position 0 (pools_whole_prompt)."""
        return req.is_pooling and self.pools_whole_prompt

    def _namespace(self, req: Request) -> int:
        return BASE_NAMESPACE if req.lora_id is None else req.lora_id

    def _keys(self, req: Request) -> list[bytes]:
        num_full = req.num_tokens // self.page_size
        if len(req.page_keys) < num_full:
            req.page_keys = page_keys(self._namespace(req), req.token_ids, self.page_size, num_full, req.page_keys,
                                      req.lora_scale, req.image_runs)  # fmt: skip
        return req.page_keys

    def _reserve(self) -> int:
        """Pages kept free for the decoding requests' next tokens, so an admission does not preempt at once."""
        return sum(1 for r in self.running.values() if r.num_scheduled_tokens % self.page_size == 0)

    def _matchable_keys(self, req: Request) -> list[bytes]:
        """Its page keys that a cached prefix may cover: not past the logits its undelivered prompt logprobs need
        (position prompt_logprob_next - 1 must be computed by the request itself)."""
        if self._needs_long_rope(req) or self._is_whole(req):
            return []  # cached pages hold short-factor KV: a long-rope request computes its own, and keeps them
        keys = self._keys(req)
        if req.wants_prompt_logprobs:
            return keys[: (req.prompt_logprob_next - 1) // self.page_size]
        return keys

    def _snapshot_positions(self, req: Request) -> list[int]:
        """Where an admitted hybrid request saves its states (past its hit): the deepest page of its prefix the KV
        cache holds, and its prompt's last full page."""
        if not (self.is_hybrid and self.cache.enabled) or req.is_long_rope:
            return []
        num_matching = self.cache.num_matching(self._matchable_keys(req), req.num_tokens)
        positions = {num_matching * self.page_size, len(req.prompt_ids) // self.page_size * self.page_size}
        return sorted(p for p in positions if p > req.num_cached_tokens)

    def _snapshot_saves(self, req: Request, num_new: int) -> list[tuple[int, int]]:
        """The (position, snapshot) saves of its next pass, writing num_new tokens: a boundary it crosses, where a
        snapshot can be had (else that one is not saved)."""
        saves = []
        end = req.num_scheduled_tokens + num_new
        while req.snapshot_positions and req.snapshot_positions[0] <= end:
            position = req.snapshot_positions.pop(0)
            snapshot = self.cache.allocate_snapshot()
            if snapshot is not None:
                saves.append((position, snapshot))
        return saves

    def _keep_snapshots(self, req: Request, saves: list[tuple[int, int]], is_written: bool) -> None:
        """A pass that saved snapshots returned: each goes to the cached page ending at its position, if the pass
        wrote it (and the page was cached); else it is freed."""
        for position, snapshot in saves:
            if is_written:
                self.cache.attach_snapshot(req.page_ids[position // self.page_size - 1], snapshot)
            else:
                self.snapshots.free(snapshot)

    def pages_wanted(self, req: Request) -> int:
        num_matched = self.cache.peek(self._matchable_keys(req), req.num_tokens)
        num_first = min(req.num_tokens - num_matched * self.page_size, max(self.prefill_budget, 1))
        return req.num_pages_for(num_matched * self.page_size + num_first, self.page_size) - num_matched

    def try_admit(self, req: Request, keep_free_pages: int) -> bool:
        if self._budget_left <= 0 or (self.is_hybrid and not self.state_slots.can_allocate()):
            return False
        req.is_long_rope = self._needs_long_rope(req)
        matched = self.cache.match(self._matchable_keys(req), req.num_tokens)
        req.page_ids, req.num_offered_pages = matched, len(matched)
        req.num_cached_tokens = req.num_scheduled_tokens = len(matched) * self.page_size
        budget_before = self._budget_left
        num_new = self._prefill_len(req)
        num_pages = self._pages_short(req, num_new)
        if num_new == 0 or num_pages + keep_free_pages + self._reserve() > self.cache.num_available:
            self.cache.release(matched)
            req.page_ids, req.num_cached_tokens, req.num_scheduled_tokens, req.num_offered_pages = [], 0, 0, 0
            self._budget_left = budget_before
            return False
        req.page_ids += self.cache.allocate(num_pages)
        if self.is_hybrid:
            req.state_slot = self.state_slots.allocate()
            num_hit_pages = req.num_cached_tokens // self.page_size
            req.restore_snapshot = self.cache.snapshot_of(req.page_ids[num_hit_pages - 1]) if num_hit_pages else -1
            req.snapshot_positions = self._snapshot_positions(req)
        self.cache.count_lookup(req.num_tokens, req.num_cached_tokens)
        if not req.num_preemptions:  # usage reports the first admission's hit (vLLM's num_cached_tokens too)
            req.num_hit_tokens_to_send = req.num_cached_tokens
        self._plan[req] = num_new
        req.sends_state = True
        return True

    def _forward_req(self, req: Request, num_new: int, prev_row: int, saves: list[tuple[int, int]],
                     num_drafts: int = 0) -> ForwardReq:  # fmt: skip
        """num_new counts its num_drafts: n-gram drafts follow its known tokens in input_ids; a draft model's the
        workers propose (num_model_drafts)."""
        drafts = self._drafts.get(req, [])
        input_ids = req.next_input_ids(num_new - num_drafts) + drafts
        if not input_ids:  # its one new token is the one the pass in flight samples
            input_ids = [0]
        else:
            prev_row = -1
        sends_state, req.sends_state, req.is_on_workers = req.sends_state, False, True
        restore_snapshot, req.restore_snapshot = req.restore_snapshot, -1  # its first pass after admission
        needs_history = sends_state and req.sampling.needs_token_history
        history_ids = req.token_ids[: req.num_scheduled_tokens] if needs_history else None
        start, end = req.prompt_logprob_span(num_new)
        return ForwardReq(
            input_ids=input_ids,
            num_cached_tokens=req.num_scheduled_tokens,
            page_ids=list(req.page_ids),
            sampling=req.sampling if sends_state else None,
            num_generated=len(req.output_ids) + req.num_pending_samples,
            slot=req.slot,
            lora_scale=req.lora_scale,
            pool=req.is_pooling and req.num_scheduled_tokens + num_new == req.num_tokens,
            prev_row=prev_row,
            req_key=req.arrival,
            history_ids=history_ids,
            prompt_logprob_ids=req.prompt_ids[start:end],
            prompt_logprob_row=max(start - 1 - req.num_scheduled_tokens, 0),
            long_rope=req.is_long_rope,
            state_slot=req.state_slot,
            restore_snapshot=restore_snapshot,
            snapshot_saves=saves,
            # a pooling request on an encoder runs its prompt whole (pools_whole_prompt): these are all its types
            token_type_ids=req.token_type_ids[req.num_scheduled_tokens : req.num_scheduled_tokens + len(input_ids)],
            num_draft_tokens=len(drafts),
            num_model_drafts=num_drafts - len(drafts),
            images=req.images_in(req.num_scheduled_tokens, len(input_ids)),
            mrope_positions=req.mrope_rows(req.num_scheduled_tokens, len(input_ids)),
            mrope_delta=req.mrope_delta,
        )

    def process_result(self, result: BatchResult) -> list[TokenDelta]:
        """The oldest pass in flight returned."""
        in_flight = self._in_flight[0] if self._in_flight else None
        if in_flight is None or result.batch_id != in_flight.batch_id:
            expected = None if in_flight is None else in_flight.batch_id
            raise ValueError(f"result for batch {result.batch_id}, but the oldest batch in flight is {expected}")
        self._in_flight.popleft()
        error = result.error_message
        if not error and len(result.next_token_ids) != len(in_flight.reqs):
            error = f"batch {result.batch_id}: {len(result.next_token_ids)} tokens for {len(in_flight.reqs)} requests"
        deltas = []
        if not error and any(in_flight.num_drafts):
            error = self._accepted_error(result, in_flight)
        rows = zip(in_flight.reqs, in_flight.num_new, in_flight.samples, in_flight.saves, in_flight.num_drafts,
                   strict=True)  # fmt: skip
        for i, (req, num_new, samples, saves, num_drafts) in enumerate(rows):
            req.num_passes_in_flight -= 1
            req.num_pending_samples -= samples
            is_written = not (error or req.is_aborted or req.status is RequestStatus.FINISHED)
            accepted = result.accepted_ids[i] if num_drafts and is_written and result.accepted_ids else []
            if num_drafts and is_written:
                num_new -= self._roll_back(req, num_drafts, len(accepted))
            if is_written:
                req.num_cached_tokens += num_new  # the pass wrote the KV of every token it was given
                self._offer_pages(req)
            self._keep_snapshots(req, saves, is_written)  # before a finish below lets its pages go
            if req.status is RequestStatus.FINISHED:  # ended while this pass was in flight: only the pages remain
                if not req.num_passes_in_flight:
                    self._let_go(req)
            elif req.is_aborted:
                if not req.num_passes_in_flight:
                    deltas.append(self._finish(req, "abort"))
            elif error:
                deltas.append(self._finish(req, "error", error_message=error))
            else:
                self._free_behind_window(req)
                prompt_logprobs = result.prompt_logprobs[i] if i < len(result.prompt_logprobs) else []
                req.prompt_logprob_next += len(prompt_logprobs)
                if samples and req.is_pooling:  # its prompt's last pass: the pooled output ends it
                    pooled = result.pooled[i] if i < len(result.pooled) else b""
                    if not pooled:
                        deltas.append(self._finish(req, "error", error_message="the workers returned no pooled output"))
                    else:
                        deltas.append(msgspec.structs.replace(self._finish(req, "stop"), pooled=pooled))
                elif samples and req.sampling.max_new_tokens == 0:  # it ran for its prompt logprobs only
                    delta = self._finish(req, "length")
                    deltas.append(msgspec.structs.replace(delta, prompt_logprobs=prompt_logprobs))
                elif samples:  # else a chunk of a longer prompt: its sampled token is not used
                    logprob = result.logprobs[i] if i < len(result.logprobs) else None
                    token_ids = [*accepted, result.next_token_ids[i]]
                    logprobs = [logprob] if logprob is not None else []
                    if accepted and logprobs and i < len(result.accepted_logprobs):
                        logprobs = [*result.accepted_logprobs[i], *logprobs]
                    deltas.append(self._append_tokens(req, token_ids, logprobs, prompt_logprobs))
                elif prompt_logprobs:
                    deltas.append(self._delta(req, [], prompt_logprobs=prompt_logprobs))
        return deltas

    @staticmethod
    def _accepted_error(result: BatchResult, in_flight: _InFlight) -> str:
        """Why the workers' accepted drafts do not fit the batch's, or ""."""
        if result.accepted_ids and len(result.accepted_ids) != len(in_flight.reqs):
            return f"batch {result.batch_id}: accepted drafts for {len(result.accepted_ids)} of {len(in_flight.reqs)}"
        for accepted, num_drafts in zip(result.accepted_ids, in_flight.num_drafts, strict=False):
            if len(accepted) > num_drafts:
                return f"batch {result.batch_id}: {len(accepted)} drafts accepted of {num_drafts}"
        return ""

    def _roll_back(self, req: Request, num_drafts: int, num_accepted: int) -> int:
        """A verify pass returned: its rejected drafts' positions, and the pages past its accepted tokens, go back
        (never offered to the prefix cache: only written full pages are). Counts it; returns the rejected count."""
        num_rejected = num_drafts - num_accepted
        req.num_scheduled_tokens -= num_rejected
        num_kept = req.num_pages_for(req.num_scheduled_tokens, self.page_size)
        if len(req.page_ids) > num_kept:
            self.cache.release(req.page_ids[num_kept:])
            del req.page_ids[num_kept:]
        if num_accepted:
            req.num_draft_misses = 0
        else:
            self._count_miss(req)
        counts = self.spec_counts.setdefault(req.lora_id, [0, 0, 0])
        counts[0] += num_drafts
        counts[1] += num_accepted
        counts[2] += 1
        return num_rejected

    @staticmethod
    def _count_miss(req: Request) -> None:
        """A verify pass accepted nothing, or there was nothing to draft: decode the next passes without drafts."""
        req.num_draft_misses += 1
        req.num_passes_without_drafts = min(2**req.num_draft_misses, MAX_PASSES_WITHOUT_DRAFTS)

    def _offer_pages(self, req: Request) -> None:
        """Full pages now written go to the prefix cache (a page another request cached first replaces ours)."""
        num_full = req.num_cached_tokens // self.page_size
        # long-factor KV, or a whole-prompt pooling request's (read both ways): no request may share it
        if num_full <= req.num_offered_pages or req.is_long_rope or self._is_whole(req):
            return
        keys = self._keys(req)
        first = req.num_offered_pages
        req.page_ids[first:num_full] = self.cache.insert(
            keys[first:num_full], req.page_ids[first:num_full], self._namespace(req)
        )
        req.num_offered_pages = num_full

    def _free_behind_window(self, req: Request) -> None:
        """Pages wholly behind every layer's window go back. The next query of any pass (in flight or to come) is at
        position num_cached_tokens or later, and sees no key before num_cached_tokens - window + 1; a pass in flight
        that still lists a freed page runs before any pass of the page's next owner writes it."""
        if self.attention_window is None:
            return
        num_behind = max(0, req.num_cached_tokens - self.attention_window + 1) // self.page_size
        first = req.num_freed_pages
        if num_behind <= first:
            return
        self.cache.release(req.page_ids[first:num_behind])  # already offered: _offer_pages ran first
        req.page_ids[first:num_behind] = [FREED_PAGE] * (num_behind - first)
        req.num_freed_pages = num_behind

    def _append_tokens(self, req: Request, token_ids: list[int], logprobs: list[TokenLogprob],
                       prompt_logprobs: list[TokenLogprob] | None = None) -> TokenDelta:
        """A pass's tokens for the request (several after accepted drafts) and their logprobs (one each where it
        asks, else []), in order until one ends it: the tokens after a stop token or past max_new_tokens are
        dropped."""
        for num_taken, token_id in enumerate(token_ids, 1):
            req.output_ids.append(token_id)
            self.order.on_output(req)
            if token_id in req.sampling.stop_token_ids and len(req.output_ids) > req.sampling.min_new_tokens:
                delta = self._finish(req, "stop", token_ids[:num_taken], logprobs=logprobs[:num_taken])
                break
            if req.num_remaining_tokens <= 0:
                delta = self._finish(req, "length", token_ids[:num_taken], logprobs=logprobs[:num_taken])
                break
        else:
            delta = self._delta(req, token_ids, logprobs=logprobs)
        return msgspec.structs.replace(delta, prompt_logprobs=prompt_logprobs) if prompt_logprobs else delta

    def stats(self, op_id: int) -> SchedulerStats:
        return SchedulerStats(
            op_id=op_id,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.cache.num_in_use / self.pages.num_pages,
            running_lora_ids=sorted({r.lora_id for r in self.running.values() if r.lora_id is not None}),
            waiting_lora_ids=sorted({r.lora_id for r in self.waiting.values() if r.lora_id is not None}),
            slot_lora_ids=self.slots.slot_table(),
            prefix_cache_hit_tokens=self.cache.num_hit_tokens,
            prefix_cache_queried_tokens=self.cache.num_queried_tokens,
            num_preemptions=self.num_preemptions,
            num_loaded_adapters=len(self.adapters.loaded_ids),
            num_state_slots=self.state_slots.num_slots,
            num_free_state_slots=self.state_slots.num_free,
            num_state_snapshots=self.snapshots.num_slots,
            num_free_state_snapshots=self.snapshots.num_free,
            spec=[SpecCount(lora_id=lora_id, num_draft_tokens=c[0], num_accepted_tokens=c[1], num_verify_passes=c[2])
                  for lora_id, c in self.spec_counts.items()],
        )

    # ---- adapters (between forward passes) --------------------------------------------------------------------

    def load_adapters(self, op: LoadAdapters, now: float) -> LoadAdapters | LoadFinished:
        """The message for every rank's loader (the outcome follows their reports), or the outcome at once."""
        return self.adapters.begin_load(op, now)

    def add_adapter_report(self, report: AdapterReport) -> LoadFinished | None:
        return self._pin(self.adapters.add_report(report))

    def expire_adapter_loads(self, now: float) -> list[LoadFinished]:
        return [self._pin(done) for done in self.adapters.expire(now)]

    def _pin(self, done: LoadFinished | None) -> LoadFinished | None:
        """The registry decided the pins; an in-place reload moves the old id's pin to the new one."""
        for adapter in done.loaded if done else []:
            if adapter.replaces is not None:
                self.slots.unpin(adapter.replaces)
            if adapter.pinned:
                try:
                    self.slots.pin(adapter.lora_id)
                except SlotError as e:  # the registry keeps to the limit, so this is a bug: say so, serve on
                    log.error("adapter %d stays unpinned: %s", adapter.lora_id, e)
        return done

    def drop_adapters(self, op: DropAdapters) -> tuple[AdapterOpDone, list[TokenDelta]]:
        """Forget adapters (between forward passes): the reply, and the requests that were still using them."""
        if self._in_flight:
            raise RuntimeError("adapters are dropped between forward passes")
        outcomes, deltas = [], []
        for lora_id in op.lora_ids:
            if not self.adapters.remove(lora_id):
                error = f"adapter id {lora_id} is not loaded"
                outcomes.append(
                    AdapterOutcome(lora_id=lora_id, success=False, error_message=error, error_kind="not_found")
                )
                continue
            # The frontend drained this adapter's requests; any that slipped through end here rather than hold a slot.
            for other in [r for r in [*self.waiting.values(), *self.running.values()] if r.lora_id == lora_id]:
                deltas.append(self._finish(other, "error", error_message=f"adapter id {lora_id} was unloaded"))
            self.slots.drop(lora_id)
            self.order.forget_adapter(lora_id)
            self.cache.purge(lora_id)  # ids are never reused: nothing would match its pages again
            outcomes.append(AdapterOutcome(lora_id=lora_id, success=True))
        return AdapterOpDone(op_id=op.op_id, outcomes=outcomes), deltas
