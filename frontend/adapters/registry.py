"""AdapterRegistry: the frontend's view of loaded adapters — names, ids, and who is using each one."""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from loraplex.protocol.errors import ServerError
from loraplex.protocol.structs import AdapterToLoad, InlineAdapter, LoRAAdapterSpec

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,127}$")


class AdapterError(ServerError):
    """An adapter operation or a request's adapter refused; `kind` picks the status code at the HTTP edge."""


@dataclass
class AdapterEntry:
    name: str
    path: str | None  # as the client gave it; None: loaded from tensors (never evicted, never saved)
    lora_id: int
    pinned: bool = False
    resolved_path: str = ""  # what the workers read (symlinks resolved)
    root: str | None = None  # every file the workers read for it must lie inside
    resident: bool = True  # the workers hold its weights (False: evicted under --max-loaded-loras, reloaded on use)
    last_used: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))  # its card's `created`: when it was loaded
    rank: int = 0
    target_modules: list[str] = field(default_factory=list)
    dora: bool = False  # DoRA: its norms are computed at its own scale, so no lora_scale or lora_mix takes it
    vocabulary: Any = None  # its own tokenizer (adapters/tokenizers.py's Vocabulary); None: the base model's
    parent: str | None = None  # its card's parent in /v1/models (--lora-modules' base_model_name); None: the base
    draft_path: str | None = None  # its draft model's adapter (resolved), loaded and dropped with it
    holders: set[str] = field(default_factory=set)  # rids of requests in flight
    draining: bool = False  # an unload has begun: no new requests
    released: asyncio.Event = field(default_factory=asyncio.Event)  # set whenever holders becomes empty

    def __post_init__(self) -> None:
        self.released.set()


class AdapterRegistry:
    """Only this object changes the name → adapter map and the in-flight holds.

    A name maps to its current adapter id; ids are minted once and never reused, so an in-place reload gets a new
    id while requests holding the old one finish on the old weights.
    """

    def __init__(self, path_root: str | None = None, max_pinned: int = 7):
        self.path_root = os.path.realpath(path_root) if path_root else None
        self.max_pinned = max_pinned  # --max-loras-per-batch - 1: one slot always rotates
        self.cache_root: str | None = None  # --lora-cache-dir: allowed beside --lora-path-root (set by allow_cache)
        self.update_lock = asyncio.Lock()  # serializes load/unload
        self._ids = itertools.count()
        self._current: dict[str, int] = {}  # name -> live id
        self._entries: dict[int, AdapterEntry] = {}  # every id still held or live
        self._wanted: Counter[str] = Counter()  # names that requests being admitted need but do not hold yet

    # ---- requests ----------------------------------------------------------------------------------

    def acquire(self, name: str, rid: str) -> AdapterEntry:
        lora_id = self._current.get(name)
        if lora_id is None:
            raise AdapterError(f"adapter {name!r} is not loaded", kind="not_found")
        entry = self._entries[lora_id]
        if entry.draining:
            raise AdapterError(f"adapter {name!r} is being unloaded", kind="not_found")
        if not entry.resident:
            raise AdapterError(f"adapter {name!r} is not resident; reload it first", kind="internal")
        entry.holders.add(rid)
        entry.released.clear()
        entry.last_used = time.monotonic()
        return entry

    def release(self, lora_id: int, rid: str) -> None:
        entry = self._entries.get(lora_id)
        if entry is None:
            return
        entry.holders.discard(rid)
        if not entry.holders:
            entry.released.set()

    def want(self, names: Iterable[str]) -> None:
        """A batch being admitted needs these (it acquires them one item at a time): evicted only as a last resort."""
        self._wanted.update(names)

    def unwant(self, names: Iterable[str]) -> None:
        self._wanted.subtract(names)
        self._wanted = +self._wanted  # drop the zeros

    # ---- load / unload (callers hold update_lock) ---------------------------------------------------

    def check_name(self, name: object, replace: bool = False) -> str:
        if not isinstance(name, str) or not NAME_PATTERN.match(name) or ":" in name:
            raise AdapterError(
                f"invalid adapter name {name!r}: use 1-128 letters, digits, '.', '_', '-', '/' (no ':')", "invalid"
            )
        if name in self._current and not replace:
            raise AdapterError(f"The lora adapter {name!r} has already been loaded.", kind="duplicate")
        if name not in self._current and replace:
            raise AdapterError(f"adapter {name!r} is not loaded, so it cannot be replaced in place", "not_found")
        if name in self._current and self._entries[self._current[name]].draining:
            raise AdapterError(f"adapter {name!r} is being unloaded", kind="busy")
        return name

    def plan_load(
        self,
        specs: list[LoRAAdapterSpec],
        replace: bool,
        root: str | None = None,
        inline: list[InlineAdapter | None] | None = None,
    ) -> list[AdapterToLoad | AdapterError]:
        """Check each adapter of one load and decide its id and pin: what to send the ranks, or why not.
        `root` narrows --lora-path-root for this load (the resolver's directory). `inline[i]`, when given, is
        spec i's content sent along: it has no path to check, and its spec's lora_path is not read."""
        planned: list[AdapterToLoad | AdapterError] = []
        num_pinned = self.num_pinned()
        names: set[str] = set()
        for spec, content in zip(specs, inline or [None] * len(specs), strict=True):
            try:
                name = self.check_name(spec.lora_name, replace=replace)
                if name in names:
                    raise AdapterError(f"adapter {name!r} appears twice in one request", "duplicate")
                names.add(name)
                path = self.check_path(name, spec.lora_path, root) if content is None else None
                draft_path = None
                if spec.draft_lora_path is not None:
                    draft_path = self.check_path(name, spec.draft_lora_path, root, field="draft_lora_path")
                old = self.get(name)
                pinned = spec.pinned if spec.pinned is not None else bool(old and old.pinned)
                if pinned and num_pinned - bool(old and old.pinned) + 1 > self.max_pinned:
                    raise AdapterError(
                        f"adapter {name!r}: too many pinned adapters (at most {self.max_pinned} = "
                        "--max-loras-per-batch - 1)",
                        "pinned_limit",
                    )
            except AdapterError as e:
                planned.append(e)
                continue
            num_pinned += pinned - bool(old and old.pinned)
            lora_id = self.mint_id()
            replaces = old.lora_id if old is not None else None
            adapter_root = None if content is not None else root or self.root_for(path)
            planned.append(AdapterToLoad(lora_id=lora_id, lora_name=name, lora_path=path, pinned=pinned,
                                         replaces=replaces, root=adapter_root, inline=content,
                                         draft_lora_path=draft_path))
        return planned

    def allow_cache(self, cache_root: str) -> None:
        """Adapters downloaded into the cache are read from there, whatever --lora-path-root says."""
        self.cache_root = os.path.realpath(cache_root)

    def root_for(self, resolved_path: str) -> str | None:
        """The root every file of the adapter at `resolved_path` must lie inside: the cache for a downloaded one."""
        if self.cache_root is not None and _is_inside(resolved_path, self.cache_root):
            return self.cache_root
        return self.path_root

    def check_path(self, name: str, path: object, root: str | None = None, field: str = "lora_path") -> str:
        """`field`: the request field that gave the path, named in the refusal (draft_lora_path: a draft adapter's)."""
        said = "path" if field == "lora_path" else field
        if not isinstance(path, str) or not path or "\x00" in path:
            raise AdapterError(f"adapter {name!r}: {field} must be a non-empty string without NUL bytes", "invalid")
        resolved = os.path.realpath(path)
        for allowed, flag in ((self.root_for(resolved), "--lora-path-root"), (root, "--lora-resolver-dir")):
            if allowed is not None and not _is_inside(resolved, allowed):
                raise AdapterError(f"adapter {name!r}: {said} {path!r} is outside the allowed root {flag}", "forbidden")
        if not os.path.exists(resolved):
            raise AdapterError(f"adapter {name!r}: {said} {path!r} does not exist", "not_found")
        if not os.path.isdir(resolved):
            raise AdapterError(f"adapter {name!r}: {said} {path!r} is not a directory", "invalid")
        return resolved

    def mint_id(self) -> int:
        return next(self._ids)

    def add(self, entry: AdapterEntry) -> AdapterEntry | None:
        """Make entry the live adapter of its name; returns the entry it replaced (in-place reload), if any."""
        old_id = self._current.get(entry.name)
        self._current[entry.name] = entry.lora_id
        self._entries[entry.lora_id] = entry
        if old_id is None:
            return None
        old = self._entries[old_id]
        old.draining = True
        return old

    def begin_unload(self, name: str) -> AdapterEntry:
        lora_id = self._current.get(name)
        if lora_id is None:
            raise AdapterError(f"adapter {name!r} is not loaded", kind="not_found")
        entry = self._entries[lora_id]
        if entry.draining:
            raise AdapterError(f"adapter {name!r} is already being unloaded", kind="busy")
        entry.draining = True
        return entry

    def cancel_unload(self, entry: AdapterEntry) -> None:
        entry.draining = False

    def eviction_candidates(self, max_resident: int | None, keep: set[str]) -> list[AdapterEntry]:
        """Least recently used host copies beyond max_resident that nobody is using; pinned ones never, nor ones
        loaded from tensors (no path to reload them from), nor `keep`. One a batch being admitted wants goes last.
        Fewer than the excess when too few are idle: the rest go at a later load or reload."""
        resident = [e for e in self.live() if e.resident]
        if max_resident is None or len(resident) <= max_resident:
            return []
        idle = [e for e in resident if not e.pinned and not e.holders and not e.draining and e.name not in keep
                and e.path is not None]
        idle.sort(key=lambda e: (self._wanted[e.name] > 0, e.last_used))
        return idle[: len(resident) - max_resident]

    def rebind(self, entry: AdapterEntry, new_id: int) -> None:
        """A reloaded host copy gets a fresh id (ids are never reused); only for entries nobody holds."""
        assert not entry.holders, "rebind of an adapter in use"
        self._entries.pop(entry.lora_id, None)
        entry.lora_id = new_id
        entry.resident = True
        entry.last_used = time.monotonic()  # it was reloaded to be used: not the next one to go
        self._entries[new_id] = entry
        self._current[entry.name] = new_id

    def forget(self, entry: AdapterEntry) -> None:
        self._entries.pop(entry.lora_id, None)
        if self._current.get(entry.name) == entry.lora_id:
            del self._current[entry.name]

    # ---- views ----------------------------------------------------------------------------------------

    def get(self, name: str) -> AdapterEntry | None:
        lora_id = self._current.get(name)
        return None if lora_id is None else self._entries[lora_id]

    def live(self) -> list[AdapterEntry]:
        return [self._entries[i] for i in self._current.values()]

    def loaded_adapters(self) -> dict[str, str | None]:
        return {e.name: e.path for e in self.live() if not e.draining}

    def num_pinned(self) -> int:
        return sum(1 for e in self.live() if e.pinned)

    def total_holds(self) -> int:
        return sum(len(e.holders) for e in self._entries.values())

    def num_entries(self) -> int:
        return len(self._entries)

    def table(self, slot_tables: list[list[int]] | None = None) -> list[dict]:
        """The /lora_adapters rows; slot_tables (each replica's lora_id per device slot, by dp_rank) adds where each
        one sits: `resident_slots` per replica, `resident_slot` on the lowest dp_rank that holds it."""
        slots_by_replica = [{lora_id: slot for slot, lora_id in enumerate(table)} for table in slot_tables or []]
        rows = []
        for e in self.live():
            resident_slots = {str(r): slots.get(e.lora_id) for r, slots in enumerate(slots_by_replica)}
            rows.append({
                "lora_name": e.name,
                "lora_path": e.path,
                "lora_id": e.lora_id,
                "rank": e.rank,
                "target_modules": e.target_modules,
                "pinned": e.pinned,
                "resident_slot": next((slot for slot in resident_slots.values() if slot is not None), None),
                "resident_slots": resident_slots,
                "requests_in_flight": len(e.holders),
                "draining": e.draining,
                "in_host_memory": e.resident,
            })
        return rows


def _is_inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root
