"""The frontend's typed errors; the edges map each kind to a status (protocol/errors.py)."""

from __future__ import annotations

from loraplex.protocol.errors import ServerError


class ServerUnavailable(ServerError):
    """The server is starting, stopping, or lost a process: requests get a 503."""

    def __init__(self, message: str):
        super().__init__(message, "unavailable")


class InputError(ServerError, ValueError):
    """Input the server cannot serve; the message goes back to the client with a 400."""

    def __init__(self, message: str):
        super().__init__(message, "invalid")


class RateLimited(ServerError):
    """A per-key rate limit is reached: 429, with Retry-After seconds (frontend/rate_limits.py)."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, "rate_limited")
        self.retry_after_s = retry_after_s
