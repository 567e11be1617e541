"""AuditLog: one JSON line per adapter operation or refusal (--audit-log), and the last ones for the console.

A line: time (UTC, ISO 8601), op (load/unload/reload/evict/resolve), op_id, names, paths, key_id (the first 8 hex of
the SHA-256 of the key the caller presented, never the key), client (its address; null for the server's own
operations), outcome ("ok" or the error kind), duration_ms. The file is rotated at 100 MB."""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone

import msgspec
from loraplex.frontend.caller import key_id
from loraplex.protocol.errors import ServerError

ROTATE_BYTES = 100 * 2**20
ROTATE_BACKUPS = 5
RECENT_LINES = 100  # what the console can show

@dataclass(frozen=True)
class Caller:
    """Who asked for an adapter operation: the client's address and the key it presented (as its id)."""

    client: str | None = None
    key_id: str | None = None

    @classmethod
    def presenting(cls, client: str | None, key: str | None) -> Caller:
        return cls(client=client, key_id=key_id(key) if key else None)


SERVER = Caller()  # the server's own operations: start-up loads, evictions, the resolver


class AuditEntry(msgspec.Struct, kw_only=True):
    time: str
    op: str
    op_id: str
    names: list[str]
    paths: list[str | None]
    key_id: str | None
    client: str | None
    outcome: str
    duration_ms: float


@dataclass
class AuditOp:
    """One operation being recorded: its outcome is "ok" until set, or the kind of the error that ends it."""

    outcome: str = "ok"
    started: float = field(default_factory=time.monotonic)

    def set_outcome(self, results: list) -> None:
        """From the per-adapter results (LoRAAdapterResult): ok, or the first failure's kind."""
        failed = next((r for r in results if not r.success), None)
        self.outcome = "ok" if failed is None else (failed.error_kind or "internal")


class AuditLog:
    def __init__(self, path: str | None):
        self.recent: deque[AuditEntry] = deque(maxlen=RECENT_LINES)
        # logging's handler for its rotation; fed directly, so the lines reach the audit file only
        self._file: logging.handlers.RotatingFileHandler | None = None
        if path:
            self._file = logging.handlers.RotatingFileHandler(path, maxBytes=ROTATE_BYTES, backupCount=ROTATE_BACKUPS,
                                                              encoding="utf-8")
        self._encoder = msgspec.json.Encoder()

    @contextlib.contextmanager
    def operation(self, op: str, names: list[str], paths: list[str | None], caller: Caller) -> Iterator[AuditOp]:
        """Record the operation run inside the block: a ServerError raised in it is its outcome (and goes on)."""
        audit_op = AuditOp()
        try:
            yield audit_op
        except ServerError as e:
            audit_op.outcome = e.kind
            raise
        except BaseException:
            audit_op.outcome = "internal"
            raise
        finally:
            self.record(op, names, paths, caller, audit_op.outcome, time.monotonic() - audit_op.started)

    def record(self, op: str, names: list[str], paths: list[str | None], caller: Caller, outcome: str,
               duration_s: float = 0.0) -> None:
        entry = AuditEntry(time=datetime.now(timezone.utc).isoformat(timespec="milliseconds"), op=op,
                           op_id=uuid.uuid4().hex[:16], names=names, paths=paths, key_id=caller.key_id,
                           client=caller.client, outcome=outcome, duration_ms=round(duration_s * 1e3, 3))
        self.recent.append(entry)
        if self._file is not None:  # a failed write (disk full) is reported by logging, never raised here
            self._file.handle(logging.makeLogRecord({"msg": self._encoder.encode(entry).decode()}))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
