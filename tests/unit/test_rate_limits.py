"""KeyRateLimits on a fake clock: the charge and refund rules frontend/rate_limits.py states, Retry-After, and the
flags' validation."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from loraplex.frontend.bodies import error_body
from loraplex.frontend.caller import caller_key_id, key_id, set_caller_key
from loraplex.frontend.entrypoints.cli import parse_command_line
from loraplex.frontend.entrypoints.ray_serve import answer
from loraplex.frontend.errors import RateLimited
from loraplex.frontend.generate import GenerateService
from loraplex.frontend.rate_limits import KeyRateLimits
from loraplex.protocol.config import ConfigError, ServerConfig
from loraplex.protocol.errors import http_status


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_requests_per_minute_with_retry_after():
    clock = Clock()
    limits = KeyRateLimits(requests_per_minute=3, tokens_per_minute=None, clock=clock)
    for _ in range(3):
        limits.admit("k1", 1, 100)
    with pytest.raises(RateLimited) as info:
        limits.admit("k1", 1, 1)
    assert info.value.retry_after_s == 20  # one request refills in 60 / 3 s
    assert info.value.kind == "rate_limited" and "requests per minute" in str(info.value)
    limits.admit("k2", 1, 1)  # another key has its own bucket
    clock.now += 19.5
    with pytest.raises(RateLimited) as info:
        limits.admit("k1", 1, 1)
    assert info.value.retry_after_s == 1
    clock.now += 0.5
    limits.admit("k1", 1, 1)
    limits.admit(None, 1, 10**9)  # no key: not limited


def test_tokens_count_prompt_at_admission_and_output_at_the_end():
    clock = Clock()
    limits = KeyRateLimits(requests_per_minute=None, tokens_per_minute=600, clock=clock)  # 10 tokens per second
    limits.admit("k", 1, 400)
    assert limits.levels("k") == (None, 200)
    with pytest.raises(RateLimited) as info:
        limits.admit("k", 1, 300)  # the prompt must be in the bucket
    assert info.value.retry_after_s == 10 and "tokens per minute" in str(info.value)
    assert limits.levels("k") == (None, 200)  # a refused request takes nothing
    limits.charge_output("k", 500)  # outputs may leave the key in debt
    assert limits.levels("k") == (None, -300)
    with pytest.raises(RateLimited) as info:
        limits.admit("k", 1, 1)
    assert info.value.retry_after_s == 31  # (1 - -300) / 10 per second, rounded up
    clock.now += 31
    limits.admit("k", 1, 1)


def test_a_prompt_larger_than_the_allowance_runs_on_a_full_bucket():
    clock = Clock()
    limits = KeyRateLimits(requests_per_minute=None, tokens_per_minute=100, clock=clock)
    limits.admit("k", 1, 500)  # a full bucket: admitted, the key then waits out its debt
    with pytest.raises(RateLimited) as info:
        limits.admit("k", 1, 500)
    assert info.value.retry_after_s == 5 * 60  # from -400 back to a full bucket of 100
    clock.now += 300
    limits.admit("k", 1, 500)


def test_refund_gives_back_what_admission_took():
    clock = Clock()
    limits = KeyRateLimits(requests_per_minute=2, tokens_per_minute=100, clock=clock)
    for _ in range(10):  # requests refused after admission (a bad adapter, a failed submit) cost nothing
        limits.admit("k", 1, 60)
        limits.refund("k", 1, 60)
    assert limits.levels("k") == (2, 100)
    limits.charge_output("k", 0)
    assert limits.levels("k") == (2, 100)


def test_rate_limited_is_a_429_named_rate_limited():
    assert http_status("rate_limited", openai=True) == http_status("rate_limited", openai=False) == 429
    assert error_body("slow down", 429).error.type == "rate_limited"


def test_flags_need_an_api_key():
    for flag in ("--max-requests-per-minute-per-key", "--max-tokens-per-minute-per-key"):
        with pytest.raises(ConfigError, match="needs --api-key"):
            parse_command_line([flag, "10"])
        with pytest.raises(ConfigError, match=">= 1"):
            parse_command_line([flag, "0", "--api-key", "k"])
    config = parse_command_line(["--max-requests-per-minute-per-key", "5", "--max-tokens-per-minute-per-key", "900",
                                 "--api-key", "k", "--max-running-per-adapter", "2", "--scheduling-policy",
                                 "priority", "--disable-adapter-fairness"])[0]
    assert (config.max_requests_per_minute_per_key, config.max_tokens_per_minute_per_key) == (5, 900)
    assert (config.max_running_per_adapter, config.scheduling_policy, config.disable_adapter_fairness) == (
        2, "priority", True)
    assert ServerConfig().scheduling_policy == "fcfs" and not ServerConfig().disable_adapter_fairness
    with pytest.raises(SystemExit):
        parse_command_line(["--scheduling-policy", "lifo"])


def test_caller_key_is_named_by_id_never_the_key():
    set_caller_key("secret-key")
    assert caller_key_id() == key_id("secret-key") and len(caller_key_id()) == 8
    assert "secret" not in caller_key_id()
    set_caller_key(None)
    assert caller_key_id() is None


def test_the_service_refunds_refused_requests_and_charges_outputs_once_on_every_path():
    clock = Clock()
    sent = []

    async def send(dp_rank, message):
        sent.append(message)

    runtime = SimpleNamespace(
        rate_limits=KeyRateLimits(requests_per_minute=None, tokens_per_minute=600, clock=clock),
        metrics=SimpleNamespace(on_finish=lambda state: None, on_submit=lambda num_prompt_tokens: None),
        router=SimpleNamespace(release=lambda *args: None, pick=lambda lora_id: 0, acquire=lambda *args: None),
        failure=None, stopping=False, replicas=SimpleNamespace(send=send), attach=lambda requests: None)
    service = GenerateService(runtime)
    set_caller_key("tenant")
    refund = service.take_rate([[7] * 100, [7] * 50])
    assert runtime.rate_limits.levels(key_id("tenant")) == (None, 450)
    refund()  # refused after admission: nothing counted
    assert runtime.rate_limits.levels(key_id("tenant")) == (None, 600)
    service.take_rate([[7] * 100])

    def state(rid: str, num_output: int, finished: bool) -> SimpleNamespace:
        return SimpleNamespace(rid=rid, key_id=key_id("tenant"), output_ids=[7] * num_output, finished=finished,
                               lora_id=None, dp_rank=0, fail=lambda message, status: None,
                               prompt_ids=[])

    done, aborted = state("done", 20, True), state("aborted", 30, False)
    service.requests.add(done)
    service.requests.add(aborted)
    asyncio.run(service.finish([done, aborted]))
    asyncio.run(service.finish([done, aborted]))  # a second finish (a route's finally after a failure) charges nothing
    assert runtime.rate_limits.levels(key_id("tenant")) == (None, 600 - 100 - 20 - 30)
    assert [type(m).__name__ for m in sent] == ["AbortReq"]  # the unfinished one was aborted
    set_caller_key(None)


def test_the_ray_ingress_answers_429_with_retry_after():
    def limited(*args) -> None:
        raise RateLimited("rate limit reached: retry after 7 s", retry_after_s=7)

    service = SimpleNamespace(runtime=SimpleNamespace(config=SimpleNamespace(api_key=None)), resolve_model=limited)

    async def collect() -> list:
        return [item async for item in answer(service, "/v1/completions", b'{"model": "m", "prompt": [5, 6]}', {})]

    head, body = asyncio.run(collect())
    assert head["status"] == 429 and head["headers"] == {"Retry-After": "7"}
    assert b'"type":"rate_limited"' in body
