"""Who sent the request being handled: the API key it came with, by id (never the key itself).

Set where a request is authenticated (the HTTP key check, the RPC server) and read where requests are admitted
(GenerateService: per-key rate limits, and the scheduler's fair share per key), so the routes in between stay as they
are. A context variable: aiohttp runs a request's middlewares and handler in one task, the RPC server each request in a
task of its own, so one request's key never leaks into another's.
"""

from __future__ import annotations

import hashlib
from contextvars import ContextVar

_key_id: ContextVar[str | None] = ContextVar("loraplex_caller_key_id", default=None)


def key_id(key: str) -> str:
    """A key's public name: the first 8 hex digits of its SHA-256."""
    return hashlib.sha256(key.encode()).hexdigest()[:8]


def set_caller_key(key: str | None) -> None:
    """The current request came with this key (already checked), or with none."""
    _key_id.set(key_id(key) if key else None)


def caller_key_id() -> str | None:
    return _key_id.get()
