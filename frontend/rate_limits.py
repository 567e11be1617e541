"""KeyRateLimits: --max-requests-per-minute-per-key and --max-tokens-per-minute-per-key, one pair of token buckets per
API key, checked when a request is admitted; past either, RateLimited (429 with Retry-After).

A bucket holds up to a minute's allowance and refills continuously (allowance / 60 per second).
- Requests: admission takes 1.
- Tokens (prompt + output): admission needs the prompt's tokens in the bucket (a prompt larger than the whole
  allowance needs a full bucket, so it can still run) and takes them; the output tokens are taken when the request
  ends, on every path (finished, failed, aborted, client gone), as many as were produced. Outputs may leave the bucket
  below zero: the key then waits until it refills.
- A refused request takes nothing; one refused after admission (a bad adapter, a failed submit) gets its prompt
  tokens and its request back (refund), so nothing is counted for work that never ran.
Requests without a key (the in-process Engine, a server without --api-key) are not limited. The buckets live as long
as the server: one pair per configured key, so nothing grows with traffic.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from loraplex.frontend.errors import RateLimited

SECONDS_PER_MINUTE = 60.0


class _Bucket:
    def __init__(self, per_minute: int, now: float):
        self.capacity = float(per_minute)
        self.per_s = per_minute / SECONDS_PER_MINUTE
        self.level = self.capacity
        self.updated_at = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated_at) * self.per_s)
        self.updated_at = now

    def wait_s(self, amount: float) -> float:
        """Seconds until the bucket holds `amount` (capped at a full bucket); 0 when it does now."""
        need = min(amount, self.capacity)
        return max(0.0, (need - self.level) / self.per_s)


class KeyRateLimits:
    def __init__(self, requests_per_minute: int | None, tokens_per_minute: int | None,
                 clock: Callable[[], float] = time.monotonic):
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self.clock = clock
        self._buckets: dict[str, tuple[_Bucket | None, _Bucket | None]] = {}

    @property
    def is_on(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    def _of(self, key_id: str) -> tuple[_Bucket | None, _Bucket | None]:
        now = self.clock()
        if key_id not in self._buckets:
            self._buckets[key_id] = (_bucket(self.requests_per_minute, now), _bucket(self.tokens_per_minute, now))
        buckets = self._buckets[key_id]
        for bucket in buckets:
            if bucket is not None:
                bucket.refill(now)
        return buckets

    def admit(self, key_id: str | None, num_requests: int, num_prompt_tokens: int) -> None:
        """Take a request's share (num_requests items, their prompts' tokens), or raise RateLimited taking nothing."""
        if key_id is None or not self.is_on:
            return
        requests, tokens = self._of(key_id)
        wait_s = max(requests.wait_s(num_requests) if requests else 0.0,
                     tokens.wait_s(num_prompt_tokens) if tokens else 0.0)
        if wait_s > 0:
            which = "requests" if requests and requests.wait_s(num_requests) > 0 else "tokens"
            raise RateLimited(f"rate limit reached: {which} per minute for this API key; retry after "
                              f"{math.ceil(wait_s)} s", retry_after_s=math.ceil(wait_s))
        if requests:
            requests.level -= num_requests
        if tokens:
            tokens.level -= num_prompt_tokens

    def refund(self, key_id: str | None, num_requests: int, num_prompt_tokens: int) -> None:
        """Give back what admit took, for work that never ran."""
        if key_id is None or not self.is_on:
            return
        requests, tokens = self._of(key_id)
        if requests:
            requests.level = min(requests.capacity, requests.level + num_requests)
        if tokens:
            tokens.level = min(tokens.capacity, tokens.level + num_prompt_tokens)

    def charge_output(self, key_id: str | None, num_tokens: int) -> None:
        """A request ended with num_tokens output tokens."""
        if key_id is None or self.tokens_per_minute is None:
            return
        _, tokens = self._of(key_id)
        tokens.level -= num_tokens

    def levels(self, key_id: str) -> tuple[float | None, float | None]:
        """What the key may still take now: (requests, tokens); None where no limit is set."""
        requests, tokens = self._of(key_id)
        return (requests.level if requests else None, tokens.level if tokens else None)


def _bucket(per_minute: int | None, now: float) -> _Bucket | None:
    return None if per_minute is None else _Bucket(per_minute, now)
