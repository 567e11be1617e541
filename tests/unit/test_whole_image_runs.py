"""whole_image_runs (WorkerReady's, for image tokens that attend both ways: Gemma 4's use_bidirectional_attention
"vision"): under chunked prefill no pass ends inside an image's placeholder run; a chunk that would is cut back to the
run's start, or stretched to its end when it starts there or inside it (a prefix hit may end inside a run). On plain
ints, with the requests of test_image_scheduler.py."""

from __future__ import annotations

from loraplex.protocol.config import ServerConfig
from loraplex.scheduler.scheduler import Scheduler

from tests.unit.test_image_scheduler import assert_no_leak, image_req, run


def make_scheduler(chunk: int, whole: bool) -> Scheduler:
    return Scheduler(ServerConfig(page_size=4), num_pages=32, context_length=256, chunked_prefill_size=chunk,
                     whole_image_runs=whole)  # fmt: skip


def spans(fwds: list) -> list[tuple[int, int]]:
    return [(f.num_cached_tokens, f.num_cached_tokens + len(f.input_ids)) for f in fwds]


def test_no_pass_ends_inside_an_image_run() -> None:
    # prompt: 3 tokens, the run at 3..8, 2 tokens; chunks of 4 would end at 4 and 8, inside the run
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
