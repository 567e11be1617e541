"""The one table from an error's kind to its HTTP status, on the native and the OpenAI-compatible API alike.

Internal code raises or returns errors with a `kind`; only the HTTP edge turns a kind into a status, through
`http_status`. The RPC and the Engine report the kind as it is (`LoRAAdapterResult.error_kind`).
"""

from __future__ import annotations

# kind -> (native status, /v1 status), as API.md's "Adapter errors" table gives them
STATUS_BY_KIND: dict[str, tuple[int, int]] = {
    "invalid": (400, 400),  # bad JSON or fields, not an adapter, rank or modules, shape
    "duplicate": (400, 400),  # the name is taken ("has already been loaded")
    "not_found": (400, 404),  # path missing, unknown adapter name
    "forbidden": (400, 400),  # a path or a file outside --lora-path-root
    "pinned_limit": (400, 400),  # too many pinned adapters
    "unauthorized": (401, 401),  # no or wrong key
    "disabled": (403, 403),  # --disable-lora-updates
    "updates_disabled": (403, 403),  # beyond loopback with no key (safe default; --allow-unauthenticated-lora-updates)
    "base_model_mismatch": (400, 400),  # adapter_config's base model is not the served one
    "manifest_missing": (400, 400),  # --lora-require-manifest and no loraplex-manifest.json (or a file not in it)
    "manifest_mismatch": (400, 400),  # a file's SHA-256 is not the manifest's
    "busy": (409, 409),  # an unload outlasted --lora-drain-timeout; the adapter is being unloaded
    "rate_limited": (429, 429),  # --max-requests-per-minute-per-key / --max-tokens-per-minute-per-key
    "timeout": (503, 503),  # a rank or replica missed --lora-load-timeout
    "unavailable": (503, 503),  # starting, stopping, or a process died
    "unsupported": (501, 501),  # a feature this server cannot serve (structured output without xgrammar importable)
    "internal": (500, 500),  # a server fault
    "invalid_lora_scale": (400, 400),  # a request's lora_scale outside [0, 4], or given without an adapter
    "invalid_lora_mix": (400, 400),  # a request's lora_mix: unknown adapters, different targets, too many, bad weights
}

ADAPTER_ERROR_KINDS = frozenset(STATUS_BY_KIND)


def http_status(kind: str, openai: bool) -> int:
    native, v1 = STATUS_BY_KIND.get(kind, STATUS_BY_KIND["internal"])
    return v1 if openai else native


class ServerError(Exception):
    """An error with a kind: the HTTP edge answers it with http_status(kind) and the message as it is."""

    def __init__(self, message: str, kind: str = "invalid"):
        super().__init__(message)
        assert kind in ADAPTER_ERROR_KINDS, kind
        self.kind = kind
