"""HostResidency: which adapters keep their host copies on the ranks under --max-loaded-loras — bring one back before
a request uses it (or load it through the resolver on its first use), evict the least recently used ones past the
limit.

Its changes happen under the registry's update lock, as every adapter operation does (frontend/adapters/manager.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection

from loraplex.frontend.adapters.audit import SERVER, AuditLog
from loraplex.frontend.adapters.delivery import AdapterDelivery, Shipment
from loraplex.frontend.adapters.registry import AdapterEntry, AdapterError, AdapterRegistry
from loraplex.frontend.adapters.sources import SourceError
from loraplex.frontend.metrics import Metrics
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.errors import ServerError
from loraplex.protocol.structs import AdapterToLoad

logger = logging.getLogger("loraplex.adapters")

# (name, the adapters not to evict) -> loaded through --lora-resolver-dir, or AdapterError; the caller holds the lock
FirstUse = Callable[[str, set[str]], Awaitable[None]]
Localize = Callable[[str], Awaitable[str]]  # a Hub or S3 path -> its local directory (SourceError if it cannot be had)


class HostResidency:
    def __init__(self, config: ServerConfig, registry: AdapterRegistry, metrics: Metrics, audit: AuditLog,
                 delivery: AdapterDelivery, localize: Localize, first_use: FirstUse):
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.audit = audit
        self.delivery = delivery
        self._localize = localize
        self._first_use = first_use

    def check_batch(self, names: Collection[str]) -> None:
        """A batch needing more adapters than --max-loaded-loras keeps in host memory could only evict what its own
        items need: refused before anything starts (SGLang's rule)."""
        limit = self.config.max_loaded_loras
        if limit is not None and len(set(names)) > limit:
            raise AdapterError(f"the batch needs {len(set(names))} distinct adapters, more than --max-loaded-loras "
                               f"({limit}) keeps in host memory; split it", "invalid")

    async def ensure(self, name: str, batch: Collection[str] = ()) -> None:
        """Before a request naming `name` is admitted: load it through the resolver on first use, or bring its
        evicted host copy back, evicting none of `batch` (the adapters its batch needs). Errors (unknown, broken)
        are raised for the request; an unknown name without a resolver is left to the caller to report."""
        entry = self.registry.get(name)
        if entry is not None and entry.resident:
            return
        if entry is None and not self.config.lora_resolver_dir:
            return
        async with self.registry.update_lock:
            entry = self.registry.get(name)  # another request may have done it meanwhile, or an unload removed it
            if entry is None:
                if self.config.lora_resolver_dir:
                    with self.audit.operation("resolve", [name], [self.config.lora_resolver_dir], SERVER):
                        await self._first_use(name, {name, *batch})
            elif not entry.resident and not entry.draining:
                with self.audit.operation("reload", [name], [entry.path], SERVER):
                    await self._reload(entry, {name, *batch})

    async def _reload(self, entry: AdapterEntry, keep: set[str]) -> None:
        """Bring an evicted host copy back from its path (checked against the root again) under a fresh id, evicting
        none of `keep`."""
        resolver_root = entry.root if entry.root != self.registry.path_root else None
        try:
            local_path = await self._localize(entry.path)  # a Hub or S3 adapter: the cache, fetched again if gone
        except SourceError as e:
            raise AdapterError(f"adapter {entry.name!r} could not be reloaded: {e}", e.kind) from e
        path = self.registry.check_path(entry.name, local_path, resolver_root)
        adapter = AdapterToLoad(lora_id=self.registry.mint_id(), lora_name=entry.name, lora_path=path,
                                pinned=entry.pinned, root=entry.root, draft_lora_path=entry.draft_path)
        outcome = (await self.delivery.load([Shipment(adapter)], "reload"))[0]
        if not outcome.success:
            kind = outcome.error_kind if outcome.error_kind in ("timeout", "unavailable") else "internal"
            raise AdapterError(f"adapter {entry.name!r} could not be reloaded: {outcome.error_message}", kind)
        self.registry.rebind(entry, adapter.lora_id)
        await self.evict_over_limit(keep)

    async def evict_over_limit(self, keep: set[str]) -> None:
        """Drop least recently used host copies past --max-loaded-loras (caller holds the update lock)."""
        victims = self.registry.eviction_candidates(self.config.max_loaded_loras, keep)
        if not victims:
            return
        # Non-resident before the first await: a request admitted while the drop is in flight must reload (it waits
        # for the update lock we hold) rather than acquire the id being dropped.
        for entry in victims:
            entry.resident = False
        try:
            await self.delivery.drop([e.lora_id for e in victims])
        except ServerError as e:  # the copies are forgotten here either way; the drop reaches a late scheduler later
            self.audit.record("evict", [v.name for v in victims], [v.path for v in victims], SERVER, e.kind)
            for entry in victims:
                self.metrics.on_adapter_op("evict", False)
                logger.error("evict adapter %s host copy: drop failed: %s", entry.name, e)
            return
        self.audit.record("evict", [v.name for v in victims], [v.path for v in victims], SERVER, "ok")
        for entry in victims:
            self.metrics.on_adapter_op("evict", True)
            logger.info("evict adapter %s host copy (least recently used, --max-loaded-loras %d)", entry.name,
                        self.config.max_loaded_loras)
