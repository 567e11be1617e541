"""An encoder's pooling requests in the scheduler (pools_whole_prompt): each prompt runs whole in one pass, chunked
prefill and the prefix cache notwithstanding, with its tokens' segments (a cross-encoder pair's token types)."""

from __future__ import annotations

from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import SamplingParams, TokenizedGenerateReq
from loraplex.scheduler.scheduler import Scheduler


def make_scheduler() -> Scheduler:
    config = ServerConfig(page_size=4, max_loras_per_batch=2, max_prefill_tokens=1024)  # prefix cache on
    return Scheduler(config, num_pages=64, context_length=64, chunked_prefill_size=8, pools_whole_prompt=True)


def pair(rid: str, types: list[int], num_tokens: int | None = None) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid=rid, input_ids=list(range(2, 2 + (num_tokens or len(types)))),
                                sampling=SamplingParams(max_new_tokens=0), pooling=True, token_type_ids=types)


def test_pair_runs_whole_with_its_token_types() -> None:
    scheduler = make_scheduler()
    types = [0] * 6 + [1] * 14  # 20 tokens: past the chunk budget of 8
    assert scheduler.add_request(pair("p", types)) == []
    batch = scheduler.schedule()
    (req,) = batch.reqs
    assert (req.num_cached_tokens, len(req.input_ids), req.pool) == (0, 20, True)
    assert req.token_type_ids == types


def test_token_types_of_another_length_are_refused() -> None:
    (delta,) = make_scheduler().add_request(pair("p", [0, 0, 1], num_tokens=5))
    assert delta.finish_reason == "error" and "3 token types for 5 prompt tokens" in delta.error_message
