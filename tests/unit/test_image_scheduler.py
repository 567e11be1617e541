"""A vision-language model's requests in the scheduler, on plain ints: each pass carries the images whose placeholder
runs overlap its tokens and its slice of the M-RoPE rows (protocol/mrope.py computes the reference rows), under
chunked prefill that cuts a run and after a preemption; the prefix cache shares pages between requests with the same
image only; requests whose images or positions do not fit their prompt are refused; no page leaks."""

from __future__ import annotations

from loraplex.protocol.config import ServerConfig
from loraplex.protocol.mrope import mrope_positions
from loraplex.protocol.structs import BatchResult, ImageInput, SamplingParams, TokenizedGenerateReq
from loraplex.scheduler.scheduler import Scheduler

from tests.scheduler_helpers import in_flight_requests

PAD = 9  # the image placeholder token
MERGE = 2
GRID = [1, 4, 6]  # 2 x 3 merged patches: a run of 6 placeholders


def image(offset: int, content: str, grid: list[int] = GRID) -> ImageInput:
    num_tokens = grid[0] * grid[1] * grid[2] // MERGE**2
    return ImageInput(offset=offset, num_tokens=num_tokens, content_hash=content, pixel_values=b"", shape=[0, 0],
                      grid_thw=grid)  # fmt: skip


def image_req(rid: str, before: list[int], content: str = "cat", after: tuple[int, ...] = (4, 5),
              max_new: int = 3) -> TokenizedGenerateReq:  # fmt: skip
    """A prompt of `before`, one image's run, then `after`, with its M-RoPE rows."""
    one = image(len(before), content)
    input_ids = before + [PAD] * one.num_tokens + list(after)
    rows, delta = mrope_positions(input_ids, PAD, [GRID], MERGE)
    return TokenizedGenerateReq(rid=rid, input_ids=input_ids, sampling=SamplingParams(max_new_tokens=max_new),
                                images=[one], mrope_positions=rows, mrope_delta=delta)  # fmt: skip


def make_scheduler(*, chunk: int = 4, num_pages: int = 32) -> Scheduler:
    return Scheduler(ServerConfig(page_size=4), num_pages=num_pages, context_length=256, chunked_prefill_size=chunk)


def run(scheduler: Scheduler) -> tuple[dict[str, list], dict[str, object]]:
    """Steps until idle, playing the workers (the token sampled is 100 + its position, as a deterministic model's
    would be); each request's ForwardReqs, and its last delta."""
    passes: dict[str, list] = {}
    finished: dict[str, object] = {}
    while not scheduler.is_idle:
        batch = scheduler.schedule()
        assert batch is not None
        for req, fwd in zip(in_flight_requests(scheduler), batch.reqs, strict=True):
            passes.setdefault(req.rid, []).append(fwd)
        next_ids = [100 + fwd.num_cached_tokens + len(fwd.input_ids) for fwd in batch.reqs]
        for delta in scheduler.process_result(BatchResult(batch_id=batch.batch_id, next_token_ids=next_ids)):
            if delta.finish_reason:
                finished[delta.rid] = delta
    return passes, finished


def assert_passes_match(req: TokenizedGenerateReq, fwds: list) -> None:
    """Every pass's images are exactly those overlapping its positions, and its rows the reference rows' slice
    (index + delta past the prompt); a pass wholly past the prompt sends none."""
    num_prompt = len(req.input_ids)
    for fwd in fwds:
        start, end = fwd.num_cached_tokens, fwd.num_cached_tokens + len(fwd.input_ids)
        assert fwd.mrope_delta == req.mrope_delta
        assert fwd.images == [i for i in req.images if i.offset < end and i.offset + i.num_tokens > start]
        if start >= num_prompt:
            assert fwd.mrope_positions == []
            continue
        expected = [[row[p] if p < num_prompt else p + req.mrope_delta for p in range(start, end)]
                    for row in req.mrope_positions]  # fmt: skip
        assert fwd.mrope_positions == expected


def assert_no_leak(scheduler: Scheduler) -> None:
    assert scheduler.is_idle and scheduler.cache.num_in_use == 0
    scheduler.cache.check()


def test_chunked_prefill_cuts_an_image_run_and_each_chunk_carries_it_with_its_positions() -> None:
    scheduler = make_scheduler(chunk=4)
    req = image_req("r", [1, 2, 3])  # the run is positions 3..8: it spans three chunks
    assert scheduler.add_request(req) == []
    passes, finished = run(scheduler)
    fwds = passes["r"]
    assert [(f.num_cached_tokens, len(f.input_ids)) for f in fwds] == [(0, 4), (4, 4), (8, 3), (11, 1), (12, 1)]
    assert [len(f.images) for f in fwds] == [1, 1, 1, 0, 0]  # the chunk at 8 still holds the run's last token
    assert_passes_match(req, fwds)
    # the three chunks' rows put together are the prompt's rows
    assert [sum((f.mrope_positions[k] for f in fwds[:3]), []) for k in range(3)] == req.mrope_positions
    assert req.mrope_delta == -3  # 11 tokens at positions 0..7: the 6-token image takes max(2, 3) = 3 positions
    assert finished["r"].finish_reason == "length"
    assert_no_leak(scheduler)


def test_the_same_image_shares_pages_and_another_image_never_does() -> None:
    scheduler = make_scheduler(chunk=64)
    first = image_req("first", [1, 2, 3])
    scheduler.add_request(first)
    run(scheduler)
    same = image_req("same", [1, 2, 3])
    other = image_req("other", [1, 2, 3], content="dog")  # the same tokens, another image
    for req in (same, other):
        scheduler.add_request(req)
    passes, finished = run(scheduler)
    assert passes["same"][0].num_cached_tokens == 8  # two full pages (the run's first five tokens among them)
    assert passes["other"][0].num_cached_tokens == 0  # page 0 holds the run's first token: keyed by the image
    # the hit ends inside the run: the pass that computes the rest still carries the whole image, and its rows
    assert passes["same"][0].images == same.images
    # ... in one pass over the rest of its prompt, then decodes: the hit inside the run costs no other pass
    shape = [(f.num_cached_tokens, len(f.input_ids), len(f.images)) for f in passes["same"]]
    assert shape == [(8, 3, 1), (11, 1, 0), (12, 1, 0)]
    assert_passes_match(same, passes["same"])
    assert_passes_match(other, passes["other"])
    assert_no_leak(scheduler)


def test_text_before_an_image_is_shared_whatever_the_image() -> None:
    scheduler = make_scheduler(chunk=64)
    scheduler.add_request(image_req("cat", [1, 2, 3, 4, 5, 6, 7, 8]))  # the run starts on page 2
    run(scheduler)
    scheduler.add_request(image_req("dog", [1, 2, 3, 4, 5, 6, 7, 8], content="dog"))
    passes, _ = run(scheduler)
    assert passes["dog"][0].num_cached_tokens == 8  # the two text pages, not the image's
    assert passes["dog"][0].images and passes["dog"][0].images[0].content_hash == "dog"
    assert_no_leak(scheduler)


def test_preempted_requests_resume_with_their_images_and_positions() -> None:
    scheduler = make_scheduler(chunk=64, num_pages=7)  # 28 tokens: two requests of 11 + 8 do not both fit
    reqs = [image_req("a", [1, 2, 3], max_new=8), image_req("b", [1, 2, 3], content="dog", max_new=8)]
    for req in reqs:
        scheduler.add_request(req)
    passes, finished = run(scheduler)
    assert scheduler.num_preemptions >= 1
    for req in reqs:
        assert_passes_match(req, passes[req.rid])
        assert finished[req.rid].finish_reason == "length"
    # a recompute after the preemption runs prompt and outputs in one pass: rows past the prompt are index + delta
    recomputed = [f for rid in ("a", "b") for f in passes[rid][1:] if f.num_cached_tokens < 11 < f.num_cached_tokens
                  + len(f.input_ids)]  # fmt: skip
    assert recomputed and all(len(f.mrope_positions[0]) == len(f.input_ids) for f in recomputed)
    assert_no_leak(scheduler)


def test_images_or_positions_that_do_not_fit_the_prompt_are_refused() -> None:
    scheduler = make_scheduler()
    good = image_req("good", [1, 2, 3])
    bad = {
        "past the end": (good.input_ids[:6], good.images, []),
        "other tokens in the run": ([1, 2, 3, PAD, 7, PAD, PAD, PAD, PAD, 4, 5], good.images, []),
        "overlapping runs": (good.input_ids, [image(3, "a"), image(5, "b")], []),
        "rows of another length": (good.input_ids, good.images, [row[:-1] for row in good.mrope_positions]),
        "two rows": (good.input_ids, good.images, good.mrope_positions[:2]),
    }
    for rid, (input_ids, images, rows) in bad.items():
        req = TokenizedGenerateReq(rid=rid, input_ids=input_ids, sampling=SamplingParams(max_new_tokens=2),
                                   images=images, mrope_positions=rows)  # fmt: skip
        [delta] = scheduler.add_request(req)
        assert delta.finish_reason == "error", rid
        assert "image" in delta.error_message or "M-RoPE" in delta.error_message, (rid, delta.error_message)
    assert scheduler.is_idle and scheduler.cache.num_in_use == 0
