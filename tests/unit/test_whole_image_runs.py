"""images_whole (WorkerReady.images_whole, for image tokens that attend both ways: Gemma 3's images in prefill,
Gemma 4's with use_bidirectional_attention "vision"): under chunked prefill no pass ends inside an image's placeholder
run (scheduler/image_runs.py). A chunk that would is cut back to the run's start, or taken through the run's end when
it starts at or inside the run (a prefix hit may end inside one) and has the pass's budget to itself, else waits a
step. On plain ints, with the requests of test_image_scheduler.py."""

from __future__ import annotations

from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import ImageInput
from loraplex.scheduler.image_runs import whole_image_len
from loraplex.scheduler.scheduler import Scheduler

from tests.unit.test_image_scheduler import assert_no_leak, image_req, run


def make_scheduler(chunk: int, whole: bool) -> Scheduler:
    return Scheduler(ServerConfig(page_size=4), num_pages=32, context_length=256, chunked_prefill_size=chunk,
                     images_whole=whole)  # fmt: skip


def spans(fwds: list) -> list[tuple[int, int]]:
    return [(f.num_cached_tokens, f.num_cached_tokens + len(f.input_ids)) for f in fwds]


def test_a_chunk_never_ends_inside_an_image_run() -> None:
    images = [ImageInput(offset=5, num_tokens=16, content_hash="a", pixel_values=b"", shape=[]),
              ImageInput(offset=30, num_tokens=16, content_hash="b", pixel_values=b"", shape=[])]
    assert whole_image_len(images, 0, 4, alone=True) == 4  # before the first run
    assert whole_image_len(images, 0, 8, alone=True) == 5  # cut back to the run's start
    assert whole_image_len(images, 5, 8, alone=True) == 16  # the run whole, past the budget, when alone
    assert whole_image_len(images, 5, 8, alone=False) == 0  # else not this step
    assert whole_image_len(images, 12, 8, alone=True) == 9  # from inside a run (a prefix hit): through its end
    assert whole_image_len(images, 21, 30, alone=False) == 30  # both ends outside every run


def test_the_scheduler_keeps_each_image_run_in_one_pass() -> None:
    """Chunks of 4 over prompts with a 6-token image run: no pass ends inside a run, the run goes whole (past the
    budget) when it starts a pass, and a request beside another waits for a pass it has alone; without the flag the
    runs are cut."""
    for whole in (True, False):
        scheduler = make_scheduler(chunk=4, whole=whole)
        reqs = [image_req("a", [1, 2, 3]), image_req("b", [1, 2, 3, 4, 5], content="dog")]
        for req in reqs:
            scheduler.add_request(req)
        passes, finished = run(scheduler)
        assert set(finished) == {"a", "b"}
        cuts = []
        for req in reqs:
            [image] = req.images
            for fwd in passes[req.rid]:
                end = fwd.num_cached_tokens + len(fwd.input_ids)
                cuts.append(image.offset < end < image.offset + image.num_tokens)
        assert not any(cuts) if whole else any(cuts)
        assert_no_leak(scheduler)


def test_one_request_s_passes_around_its_image_run() -> None:
    # prompt: 3 tokens, the run at 3..9, 2 tokens; chunks of 4 would end at 4 and 8, inside the run
    plain = make_scheduler(chunk=4, whole=False)
    plain.add_request(image_req("r", [1, 2, 3]))
    assert spans(run(plain)[0]["r"])[:3] == [(0, 4), (4, 8), (8, 11)]
    whole = make_scheduler(chunk=4, whole=True)
    whole.add_request(image_req("r", [1, 2, 3]))
    passes, finished = run(whole)
    # cut back to the run's start, then the run whole (6 > the budget of 4) with nothing after it
    assert spans(passes["r"])[:3] == [(0, 3), (3, 9), (9, 11)] and "r" in finished
    assert_no_leak(whole)
    # a run the chunk does not reach is left as it is; one that fits is taken with what follows
    wide = make_scheduler(chunk=16, whole=True)
    wide.add_request(image_req("r", [1, 2, 3]))
    assert spans(run(wide)[0]["r"])[0] == (0, 11)
