"""What the aiohttp app and the Ray replica answer alike, without a web framework: JSON and Server-Sent Events
bytes, the API-key check, and the status and message of a failure."""

from __future__ import annotations

import hmac
import logging

import msgspec
from loraplex.protocol.errors import ServerError, http_status

logger = logging.getLogger("loraplex.http")

SSE_DONE = b"data: [DONE]\n\n"

_encoder = msgspec.json.Encoder()


def encode_json(obj: object) -> bytes:
    return _encoder.encode(obj)


def sse_event(obj: object) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def named_sse_event(event: msgspec.Struct) -> bytes:
    """A Responses API event, named by its type tag (`event: <type>` then `data: <event>`), as OpenAI sends it."""
    kind = type(event).__struct_config__.tag
    return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(event) + b"\n\n"


def presented_key(authorization: str, x_api_key: str) -> str:
    """A request's key: `Authorization: Bearer <key>`, else `X-API-Key: <key>` ("" if none)."""
    return authorization[7:] if authorization.startswith("Bearer ") else x_api_key


def key_matches(authorization: str, x_api_key: str, key: str) -> bool:
    """The request's key against `key`, in constant time."""
    return hmac.compare_digest(presented_key(authorization, x_api_key).encode(), key.encode())


def failure(e: Exception, openai: bool, where: str) -> tuple[str, int]:
    """(message, status) of a failure at the edge: a ServerError's kind picks the status (vLLM's on the OpenAI
    routes); anything else is logged and answers 500."""
    if isinstance(e, ServerError):  # InputError, AdapterError, ServerUnavailable
        return str(e), http_status(e.kind, openai=openai)
    logger.error("internal error on %s", where, exc_info=e)
    return f"internal server error: {type(e).__name__}: {e}", 500
