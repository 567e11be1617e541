"""The scheduler's engine core on plain ints: pages on demand and preemption, chunked prefill, and the prefix cache
keyed by adapter (its own unit tests, and the scheduler under random traffic with every invariant checked)."""

from __future__ import annotations

import random

import msgspec
import pytest
from loraplex.protocol.structs import AdapterOpDone, BatchResult, DropAdapters
from loraplex.scheduler.page_allocator import PageAllocator
from loraplex.scheduler.prefix_cache import BASE_NAMESPACE, PrefixCache, page_keys
from loraplex.scheduler.request import FREED_PAGE

from tests.scheduler_helpers import in_flight_requests
from tests.unit.test_scheduler_core import Workers, assert_drained, gen, load, make_scheduler


def by_position(rid: str, fwd) -> int:
    """A deterministic model's next token: a function of the sequence so far (here its length), never of batching."""
    return 100 + fwd.num_cached_tokens + len(fwd.input_ids)


# ---- PrefixCache ------------------------------------------------------------------------------------------------


def test_page_keys_chain_the_whole_prefix_and_the_namespace():
    tokens = list(range(12))
    keys = page_keys(BASE_NAMESPACE, tokens, 4, 3)
    assert len(set(keys)) == 3
    assert page_keys(BASE_NAMESPACE, tokens, 4, 3, keys[:1]) == keys  # resumable
    assert page_keys(7, tokens, 4, 3)[0] != keys[0]  # an adapter has its own namespace
    half = page_keys(7, tokens, 4, 3, lora_scale=0.5)  # ... and each strength of it its own
    assert half[0] != page_keys(7, tokens, 4, 3)[0] and half[0] != page_keys(7, tokens, 4, 3, lora_scale=0.25)[0]
    assert page_keys(7, tokens, 4, 3, half[:1], lora_scale=0.5) == half  # resumable
    other = page_keys(BASE_NAMESPACE, [99, *tokens[1:]], 4, 3)
    assert other[1] != keys[1] and other[2] != keys[2]  # a page's key covers every token before it


def test_cache_matches_shares_evicts_lru_and_never_matches_the_last_token():
    cache = PrefixCache(PageAllocator(6), page_size=4)
    tokens = list(range(13))
    keys = page_keys(BASE_NAMESPACE, tokens, 4, 3)
    pages = cache.allocate(3)
    assert cache.insert(keys, pages, BASE_NAMESPACE) == pages
    assert cache.match(keys, 13) == pages  # 3 full pages; the 13th token is computed anew
    assert cache.match(keys[:3], 12) == pages[:2]  # 12 tokens: the last page holds the last token
    cache.check()
    cache.release(pages)  # the first request
    cache.release(pages)
    cache.release(pages[:2])
    assert cache.num_in_use == 0 and cache.num_available == 6 and cache.num_cached == 3
    # A page computed twice (two requests at once): the second copy is freed and the cached page used instead.
    twin = cache.allocate(1)
    assert cache.insert(keys[:1], twin, BASE_NAMESPACE) == pages[:1]
    assert cache.pages.num_free == 3
    cache.release(pages[:1])
    # Allocation evicts unused cached pages, least recently used first (page 2 is the oldest release).
    cache.allocate(4)
    assert cache.num_cached == 2 and cache.peek(keys, 13) == 2
    assert cache.match(keys, 13) == pages[:2]
    cache.check()


def test_purge_drops_only_the_unused_pages_of_one_namespace():
    cache = PrefixCache(PageAllocator(4), page_size=2)
    for namespace in (3, 4):
        keys = page_keys(namespace, [1, 2, 3, 4], 2, 2)
        pages = cache.insert(keys, cache.allocate(2), namespace)
        if namespace == 3:
            cache.release(pages)  # nobody uses namespace 3's pages any more; namespace 4's are still in use
    cache.purge(3)
    assert cache.num_cached == 2 and cache.pages.num_free == 2
    cache.purge(4)  # used pages stay
    assert cache.num_cached == 2
    cache.check()


def test_disabled_cache_matches_nothing():
    cache = PrefixCache(PageAllocator(4), page_size=2, enabled=False)
    keys = page_keys(BASE_NAMESPACE, [1, 2, 3, 4], 2, 2)
    pages = cache.allocate(2)
    assert cache.insert(keys, pages, BASE_NAMESPACE) == pages
    assert cache.match(keys, 5) == [] and cache.num_cached == 0


# ---- the scheduler ------------------------------------------------------------------------------------------------


def test_a_shared_prefix_is_reused_for_the_same_adapter_only():
    sched = make_scheduler(num_pages=64, page_size=4, prefix_cache=True)
    load(sched, 1)
    workers = Workers(sched, by_position)
    sched.add_request(gen("first", prompt_len=13, max_new=2))
    workers.run_until_idle()
    firsts = {}
    for rid, lora in (("same", None), ("adapter", 1), ("again", None)):
        sched.add_request(gen(rid, prompt_len=13, max_new=2, lora=lora))
        batch = workers.step()
        firsts[rid] = batch.reqs[0].num_cached_tokens
        workers.run_until_idle()
    assert firsts == {"same": 12, "adapter": 0, "again": 12}
    assert workers.outputs["same"] == workers.outputs["first"] == workers.outputs["again"]
    assert sched.stats(op_id=0).prefix_cache_hit_tokens == 24
    assert_drained(sched)


@pytest.mark.parametrize("chunked_prefill_size", [-1, 4])
def test_each_request_s_first_delta_carries_its_prefix_cache_hit(chunked_prefill_size):
    # Usage's cached_tokens: the prompt tokens the first admission took from the cache, in whole pages and never
    # the last prompt token's page; sent once, with the request's first delta (a chunked prompt's comes later).
    sched = make_scheduler(num_pages=64, page_size=4, prefix_cache=True, chunked_prefill_size=chunked_prefill_size)
    load(sched, 1)
    workers = Workers(sched, by_position)
    hits = {}
    for rid, prompt_len, lora in (("first", 13, None), ("same", 13, None), ("shorter", 9, None), ("adapter", 13, 1),
                                  ("page_exact", 12, None)):
        sched.add_request(gen(rid, prompt_len=prompt_len, max_new=3, lora=lora))
        workers.run_until_idle()
        deltas = workers.deltas[rid]
        assert all(d.num_cached_prompt_tokens == 0 for d in deltas[1:]), deltas
        hits[rid] = deltas[0].num_cached_prompt_tokens
    assert hits == {"first": 0, "same": 12, "shorter": 8, "adapter": 0, "page_exact": 8}
    assert sched.stats(op_id=0).prefix_cache_hit_tokens == sum(hits.values())
    assert_drained(sched)


def test_a_preempted_request_reports_its_first_admission_s_hit():
    sched = make_scheduler(num_pages=4, page_size=4, prefix_cache=True)  # 16 tokens: b is preempted once
    workers = Workers(sched, by_position)
    sched.add_request(gen("warm", prompt_len=5, max_new=1))
    workers.run_until_idle()
    sched.add_request(gen("a", prompt_len=5, max_new=10))
    sched.add_request(gen("b", prompt_len=5, max_new=10))
    workers.run_until_idle()
    assert sched.num_preemptions == 1  # its recompute finds the page again, and says nothing of it
    for rid in ("a", "b"):
        assert [d.num_cached_prompt_tokens for d in workers.deltas[rid]] == [4] + [0] * 9
    assert_drained(sched)


def test_a_dropped_adapter_s_pages_are_never_matched_again():
    sched = make_scheduler(num_pages=64, page_size=4, prefix_cache=True)
    load(sched, 1)
    workers = Workers(sched, by_position)
    sched.add_request(gen("a", prompt_len=9, lora=1))
    workers.run_until_idle()
    assert sched.cache.num_cached > 0
    reply, _ = sched.drop_adapters(DropAdapters(op_id=5, lora_ids=[1]))
    assert isinstance(reply, AdapterOpDone) and reply.outcomes[0].success
    assert sched.cache.num_cached == 0  # its pages went with it
    # An in-place reload mints a new id: a new namespace, so nothing computed under id 1 matches.
    load(sched, 2)
    sched.add_request(gen("b", prompt_len=9, lora=2))
    assert workers.step().reqs[0].num_cached_tokens == 0
    workers.run_until_idle()
    assert_drained(sched)


def test_chunked_prefill_spreads_a_long_prompt_while_decodes_keep_their_pace():
    sched = make_scheduler(num_pages=64, page_size=4, chunked_prefill_size=8, max_prefill=8)
    workers = Workers(sched, by_position)
    sched.add_request(gen("stream", prompt_len=4, max_new=20))
    workers.step()
    sched.add_request(gen("long", prompt_len=30, max_new=2))
    chunks = []
    for _ in range(6):
        batch = workers.step()
        rows = {len(r.input_ids) for r in batch.reqs}
        assert 1 in rows  # the stream decodes in every step
        chunks.append(max(len(r.input_ids) for r in batch.reqs))
    assert chunks[:4] == [8, 8, 8, 6]
    workers.run_until_idle()
    assert workers.outputs["long"] == [130, 131]
    assert len(workers.outputs["stream"]) == 20
    assert_drained(sched)


def test_without_chunking_a_prompt_longer_than_the_budget_runs_alone():
    sched = make_scheduler(num_pages=64, page_size=4, chunked_prefill_size=-1, max_prefill=8)
    workers = Workers(sched, by_position)
    sched.add_request(gen("long", prompt_len=20, max_new=1))
    sched.add_request(gen("short", prompt_len=4, max_new=1))
    assert [len(r.input_ids) for r in workers.step().reqs] == [20]
    assert [len(r.input_ids) for r in workers.step().reqs] == [4]
    workers.run_until_idle()
    assert_drained(sched)


def test_requests_without_a_token_limit_are_not_capped_by_the_context_length():
    # 64 pages of 4 = 256 tokens, context 256: the old rule (reserve the whole context) ran one at a time.
    sched = make_scheduler(num_pages=64, page_size=4, context_length=256, max_running=16)
    workers = Workers(sched, by_position)
    for i in range(8):
        sched.add_request(gen(f"r{i}", prompt_len=8, max_new=248))
    workers.step()
    assert len(sched.running) == 8
    workers.run_until_idle()
    assert all(len(out) == 248 for out in workers.outputs.values())
    assert sched.num_preemptions > 0
    assert_drained(sched)


def test_a_request_that_can_never_fit_is_refused_at_once():
    sched = make_scheduler(num_pages=4, page_size=4, context_length=64)
    [delta] = sched.add_request(gen("big", prompt_len=10, max_new=7))
    assert delta.finish_reason == "error" and "KV cache capacity" in delta.error_message


@pytest.mark.parametrize("seed", range(16))
def test_random_traffic_under_pressure_gives_the_unpressured_outputs(seed):
    """Arrivals, finishes, preemptions, chunks and cache hits: every invariant holds each step (Workers checks),
    nothing is cached under the wrong adapter, nobody starves, and each output equals a roomy run's."""
    rng = random.Random(seed)
    traffic = []
    for step in range(40):
        for _ in range(rng.randint(0, 2)):
            prompt_len = rng.randint(1, 20)
            traffic.append((step, f"r{len(traffic)}", prompt_len, rng.randint(1, 16), rng.choice([None, 0, 1, 2])))

    def run(**options) -> tuple[dict, int]:
        sched = make_scheduler(page_size=4, num_slots=2, context_length=64, **options)
        load(sched, 0, 1, 2)
        workers = Workers(sched, by_position)
        for step in range(40):
            for _, rid, prompt_len, max_new, lora in [t for t in traffic if t[0] == step]:
                workers.record(sched.add_request(gen(rid, prompt_len=prompt_len, max_new=max_new, lora=lora)))
            workers.step()
            check_cache_namespaces(sched)
        workers.run_until_idle()
        assert_drained(sched)
        return dict(workers.outputs), sched.num_preemptions

    reference, _ = run(num_pages=400, max_running=64)
    pressured, num_preemptions = run(
        num_pages=rng.randint(10, 20),
        max_running=rng.randint(2, 8),
        chunked_prefill_size=rng.randint(3, 12),
        max_prefill=64,
        prefix_cache=True,
        attention_window=rng.choice([None, 5, 9]),  # a sliding-window model gives pages back as it goes
    )
    assert pressured == reference
    assert set(pressured) == {t[1] for t in traffic}


def check_cache_namespaces(sched) -> None:
    cache = sched.cache
    for req in sched.running.values():
        namespace = BASE_NAMESPACE if req.lora_id is None else req.lora_id
        for i, page_id in enumerate(req.page_ids):
            if i >= req.num_freed_pages and page_id in cache._key_of_page:
                assert cache._namespace_of_page[page_id] == namespace
                assert cache._key_of_page[page_id] == req.page_keys[i]


# ---- two passes in flight (overlap) ---------------------------------------------------------------------------


def chained(rid: str, fwd) -> int:
    """A next token that depends on the input token too: a wrong token put in for prev_row changes every output."""
    return 10 + (fwd.input_ids[-1] * 31 + fwd.num_cached_tokens + len(fwd.input_ids)) % 997


class OverlapWorkers(Workers):
    """Plays workers that run passes in the order they are sent, with up to two in flight: the scheduler sends the
    next pass before it processes the previous one's result, as the scheduler process does."""

    def __init__(self, sched, next_token):
        super().__init__(sched, next_token)
        self.results = []  # (batch, tokens) in the order sent
        self.last_tokens: list[int] = []

    def step(self, error_message: str = ""):
        sched = self.sched
        while sched.can_schedule:
            batch = sched.schedule()
            if batch is None:
                break
            reqs = in_flight_requests(sched)
            self.keep_state(batch, reqs)
            resolved = []
            for fwd in batch.reqs:
                if fwd.prev_row >= 0:
                    assert fwd.input_ids == [0] and len(self.results) > 0
                    fwd = msgspec.structs.replace(fwd, input_ids=[self.last_tokens[fwd.prev_row]], prev_row=-1)
                assert len(fwd.page_ids) == -(-(fwd.num_cached_tokens + len(fwd.input_ids)) // sched.page_size)
                resolved.append(fwd)
            self.last_tokens = [self.next_token(req.rid, fwd) for req, fwd in zip(reqs, resolved, strict=True)]
            self.results.append((batch, self.last_tokens))
        if not self.results:
            assert not sched.running and not sched.waiting and not sched.has_batch_in_flight
            return None
        batch, tokens = self.results.pop(0)
        self.record(sched.process_result(BatchResult(batch_id=batch.batch_id, next_token_ids=tokens)))
        sched.cache.check()
        return batch


@pytest.mark.parametrize("seed", range(12))
def test_two_passes_in_flight_give_the_same_outputs(seed):
    rng = random.Random(seed)
    traffic = []
    for step in range(30):
        for _ in range(rng.randint(0, 2)):
            traffic.append((step, f"r{len(traffic)}", rng.randint(1, 20), rng.randint(1, 16), rng.choice([None, 0, 1]),
                            rng.random() < 0.3))

    def run(workers_type, **options):
        sched = make_scheduler(page_size=4, num_slots=2, context_length=64, **options)
        load(sched, 0, 1)
        workers = workers_type(sched, chained)
        for step in range(30):
            for _, rid, prompt_len, max_new, lora, stops in [t for t in traffic if t[0] == step]:
                stop = tuple(range(10, 60)) if stops else ()  # some end early on a stop token, mid-overlap
                workers.record(sched.add_request(gen(rid, prompt_len=prompt_len, max_new=max_new, lora=lora,
                                                     stop=stop)))
            workers.step()
        for _ in range(10_000):
            if workers.step() is None:
                break
        assert_drained(sched)
        return {rid: (out, workers.finished[rid].finish_reason) for rid, out in workers.outputs.items()}

    reference = run(Workers, num_pages=400, max_running=64)
    overlapped = run(OverlapWorkers, num_pages=rng.randint(12, 30), max_running=rng.randint(2, 8),
                     chunked_prefill_size=rng.randint(3, 12), max_prefill=64, prefix_cache=True,
                     attention_window=rng.choice([None, 5, 9]))  # fmt: skip
    assert overlapped == reference


def test_a_stop_token_in_the_older_pass_drops_the_newer_pass_s_token_and_holds_pages_until_it_returns():
    sched = make_scheduler(num_pages=16, page_size=4)
    sched.add_request(gen("a", prompt_len=3, max_new=10, stop=(5,)))
    first = sched.schedule()
    second = sched.schedule()
    assert second.reqs[0].prev_row == 0 and second.reqs[0].num_generated == 1
    deltas = sched.process_result(BatchResult(batch_id=first.batch_id, next_token_ids=[5]))
    assert [(d.token_ids, d.finish_reason) for d in deltas] == [([5], "stop")]
    assert not sched.running and sched.cache.num_in_use == 1  # its page is still being written by the second pass
    assert sched.schedule() is None
    assert sched.process_result(BatchResult(batch_id=second.batch_id, next_token_ids=[9])) == []
    assert_drained(sched)


def test_abort_with_two_passes_in_flight_ends_when_the_last_returns():
    sched = make_scheduler(num_pages=16, page_size=4)
    sched.add_request(gen("a", prompt_len=3, max_new=10))
    first, second = sched.schedule(), sched.schedule()
    assert sched.abort("a") == []
    assert sched.process_result(BatchResult(batch_id=first.batch_id, next_token_ids=[7])) == []
    [delta] = sched.process_result(BatchResult(batch_id=second.batch_id, next_token_ids=[7]))
    assert delta.finish_reason == "abort"
    assert_drained(sched)


def test_a_request_at_its_token_limit_is_not_sent_again():
    sched = make_scheduler(num_pages=16, page_size=4)
    sched.add_request(gen("a", prompt_len=3, max_new=1))
    sched.schedule()
    assert sched.schedule() is None  # its one token is in flight already


# ---- sliding windows: pages behind every layer's window go back --------------------------------------------------


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_pages_behind_the_window_go_back_to_the_pool(prefix_cache):
    window, page_size = 6, 4
    sched = make_scheduler(num_pages=40, page_size=page_size, chunked_prefill_size=8, prefix_cache=prefix_cache,
                           attention_window=window)  # fmt: skip
    workers = Workers(sched, by_position)
    workers.record(sched.add_request(gen("long", prompt_len=30, max_new=40)))
    req = sched.waiting["long"]
    most_held = most_freed = 0
    while "long" not in workers.finished:
        workers.step()
        if "long" in sched.running:
            behind = max(0, req.num_cached_tokens - window + 1) // page_size
            assert req.num_freed_pages == behind and req.page_ids[:behind] == [FREED_PAGE] * behind
            # Only the window's pages (and the one being filled) are in use; the rest are back in the pool.
            assert sched.cache.num_in_use == len(req.live_page_ids) <= -(-window // page_size) + 2
            assert sched.cache.num_available == sched.pages.num_pages - len(req.live_page_ids)
            most_held = max(most_held, len(req.live_page_ids))
            most_freed = req.num_freed_pages
    assert most_freed > 10 and most_held <= 4  # 70 tokens in 18 pages, never more than 4 held at once
    assert workers.outputs["long"] == [100 + 30 + i for i in range(40)]
    assert_drained(sched)


def test_a_model_with_a_full_attention_layer_frees_nothing():
    sched = make_scheduler(num_pages=40, page_size=4, chunked_prefill_size=8, attention_window=None)
    workers = Workers(sched, by_position)
    workers.record(sched.add_request(gen("long", prompt_len=30, max_new=10)))
    req = sched.waiting["long"]
    for _ in range(8):
        workers.step()
    assert req.num_freed_pages == 0 and sched.cache.num_in_use == len(req.page_ids) == -(-req.num_cached_tokens // 4)


def test_a_request_that_waits_for_pages_counts_its_prefix_lookup_once():
    # /metrics' hit rate: a waiting request matches cached pages at every try but counts only when admitted.
    sched = make_scheduler(num_pages=4, page_size=4, prefix_cache=True)
    workers = Workers(sched, by_position)
    sched.add_request(gen("warm", prompt_len=5, max_new=1))
    workers.run_until_idle()
    sched.add_request(gen("hog", prompt_len=13, max_new=3))  # all 4 pages while it runs
    workers.step()
    sched.add_request(gen("waiter", prompt_len=5, max_new=2))
    workers.step()
    assert "waiter" not in workers.deltas  # still waiting: its lookups so far do not count
    assert sched.stats(op_id=0).prefix_cache_queried_tokens == 5 + 13
    workers.run_until_idle()
    assert sched.num_preemptions == 0
    stats = sched.stats(op_id=0)
    assert stats.prefix_cache_queried_tokens == 5 + 13 + 5
    assert stats.prefix_cache_hit_tokens == 0 + 4 + 4
    assert_drained(sched)
