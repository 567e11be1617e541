"""AdapterManager: the load / unload / reload flow of adapters, between the registry and the scheduler.

Loads and unloads are serialized by the registry's update lock; an unload waits for the adapter's requests
outside the lock, so other adapter changes go on meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from frontend.metrics import Metrics
from frontend.registry import AdapterEntry, AdapterError, AdapterRegistry
from protocol.config import ServerConfig
from protocol.structs import (
    LoadLoRAAdapterReqInput,
    LoadLoRAAdapterReqOutput,
    LoRAAdapterResult,
    LoRAAdapterSpec,
    UnloadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqOutput,
)

logger = logging.getLogger("loraplex.adapters")


class AdapterManager:
    def __init__(
        self,
        config: ServerConfig,
        registry: AdapterRegistry,
        metrics: Metrics,
        call: Callable[[Any, type], Awaitable[Any]],
        check_available: Callable[[], None],
    ):
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self._call = call  # send a control message to the scheduler and await its reply
        self.check_available = check_available

    async def load(self, specs: list[LoRAAdapterSpec], load_inplace: bool = False) -> LoadLoRAAdapterReqOutput:
        if not self.config.lora_enabled:
            results = [_failed(s.lora_name, "LoRA is not enabled (start with --enable-lora)", "invalid") for s in specs]
            return _merge(LoadLoRAAdapterReqOutput, results, {})
        async with self.registry.update_lock:
            results: list[LoRAAdapterResult | None] = [None] * len(specs)
            to_load: list[tuple[int, LoRAAdapterSpec]] = []
            names_seen: set[str] = set()
            for i, spec in enumerate(specs):
                try:
                    name = self.registry.check_name(spec.lora_name, replace=load_inplace)
                    if name in names_seen:
                        raise AdapterError(f"adapter {name!r} appears twice in one request", "duplicate")
                    names_seen.add(name)
                    path = self.registry.check_path(name, spec.lora_path)
                    old = self.registry.get(name)
                    pinned_after = self.registry.num_pinned() - (1 if old and old.pinned else 0)
                    pinned_after += sum(1 for _, s in to_load if s.pinned) + (1 if spec.pinned else 0)
                    if spec.pinned and pinned_after > self.config.max_loras_per_batch - 1:
                        raise AdapterError(
                            f"adapter {name!r}: too many pinned adapters (at most "
                            f"{self.config.max_loras_per_batch - 1} = --max-loras-per-batch - 1)",
                            "pinned_limit",
                        )
                except AdapterError as e:
                    results[i] = _failed(spec.lora_name if isinstance(spec.lora_name, str) else "", str(e), e.kind)
                    continue
                to_load.append(
                    (
                        i,
                        LoRAAdapterSpec(
                            lora_name=name, lora_path=path, pinned=spec.pinned, lora_id=self.registry.mint_id()
                        ),
                    )
                )
            if to_load:
                t0 = time.monotonic()
                self.check_available()
                reply: LoadLoRAAdapterReqOutput = await self._call(
                    LoadLoRAAdapterReqInput(adapters=[s for _, s in to_load]), LoadLoRAAdapterReqOutput
                )
                elapsed_ms = (time.monotonic() - t0) * 1e3
                by_name = {r.lora_name: r for r in reply.results}
                for i, spec in to_load:
                    result = by_name.get(spec.lora_name) or _failed(
                        spec.lora_name, "no result from workers", "internal"
                    )
                    if not result.success and repr(spec.lora_name) not in result.error_message:
                        message = f"adapter {spec.lora_name!r}: {result.error_message}"
                        result = msgspec.structs.replace(result, error_message=message)
                    results[i] = result
                    if result.success:
                        entry = AdapterEntry(
                            name=spec.lora_name,
                            path=specs[i].lora_path,
                            lora_id=spec.lora_id,
                            pinned=spec.pinned,
                            resolved_path=spec.lora_path,
                            rank=result.rank,
                            target_modules=list(result.target_modules),
                        )
                        replaced = self.registry.add(entry)
                        if replaced is not None:
                            asyncio.get_running_loop().create_task(self._retire(replaced))
                    self.metrics.on_adapter_op("load", result.success)
                    logger.info(
                        "load adapter %s path=%s rank=%s %s in %.1f ms%s",
                        spec.lora_name,
                        spec.lora_path,
                        result.rank or "?",
                        "ok" if result.success else "FAILED",
                        elapsed_ms,
                        "" if result.success else f": {result.error_message}",
                    )
            await self._evict_over_limit({s.lora_name for _, s in to_load})
            for i, r in enumerate(results):
                if r is not None and not r.success and all(i != j for j, _ in to_load):
                    self.metrics.on_adapter_op("load", False)
                    logger.info("load adapter %s refused: %s", r.lora_name, r.error_message)
        self.metrics.set_resident(len(self.registry.live()))
        return _merge(LoadLoRAAdapterReqOutput, results, self.registry.loaded_adapters())

    async def _evict_over_limit(self, keep: set[str]) -> None:
        """Drop least recently used host copies past --max-loaded-loras (caller holds the update lock)."""
        victims = self.registry.eviction_candidates(self.config.max_loaded_loras, keep)
        if not victims:
            return
        await self._call(
            UnloadLoRAAdapterReqInput(lora_names=[e.name for e in victims], lora_ids=[e.lora_id for e in victims]),
            UnloadLoRAAdapterReqOutput,
        )
        for entry in victims:
            entry.resident = False
            logger.info(
                "evict adapter %s host copy (least recently used, --max-loaded-loras %d)",
                entry.name,
                self.config.max_loaded_loras,
            )

    async def reload(self, name: str) -> None:
        """Bring an evicted adapter back from its path before a request for it is admitted."""
        async with self.registry.update_lock:
            entry = self.registry.get(name)
            if entry is None or entry.resident or entry.draining:
                return  # unloaded meanwhile (acquire reports it), or another request reloaded it
            t0 = time.monotonic()
            spec = LoRAAdapterSpec(
                lora_name=name, lora_path=entry.resolved_path, pinned=entry.pinned, lora_id=self.registry.mint_id()
            )
            reply = await self._call(LoadLoRAAdapterReqInput(adapters=[spec]), LoadLoRAAdapterReqOutput)
            result = reply.results[0] if reply.results else _failed(name, "no result from workers", "internal")
            if not result.success:
                raise AdapterError(f"adapter {name!r} could not be reloaded: {result.error_message}", "internal")
            self.registry.rebind(entry, spec.lora_id)
            logger.info("reload adapter %s path=%s in %.1f ms", name, entry.path, (time.monotonic() - t0) * 1e3)
            await self._evict_over_limit({name})

    async def _retire(self, entry: AdapterEntry) -> None:
        """After an in-place reload: drop the old weights once the requests running on them finish."""
        await entry.released.wait()
        async with self.registry.update_lock:
            await self._drop([entry])

    async def _drop(self, entries: list[AdapterEntry]) -> None:
        resident = [e for e in entries if e.resident]
        if resident:
            await self._call(
                UnloadLoRAAdapterReqInput(
                    lora_names=[e.name for e in resident], lora_ids=[e.lora_id for e in resident]
                ),
                UnloadLoRAAdapterReqOutput,
            )
        for entry in entries:
            self.registry.forget(entry)

    async def unload(self, names: list[str]) -> UnloadLoRAAdapterReqOutput:
        results: list[LoRAAdapterResult | None] = [None] * len(names)
        draining: list[tuple[int, AdapterEntry]] = []
        async with self.registry.update_lock:
            for i, name in enumerate(names):
                try:
                    draining.append((i, self.registry.begin_unload(name)))
                except AdapterError as e:
                    results[i] = _failed(name, str(e), e.kind)
        # Wait for in-flight requests outside the lock, so other loads and unloads go on meanwhile.
        timeout_s = self.config.lora_drain_timeout
        waits = [asyncio.wait_for(entry.released.wait(), timeout_s) for _, entry in draining]
        outcomes = await asyncio.gather(*waits, return_exceptions=True)
        drained: list[tuple[int, AdapterEntry]] = []
        for (i, entry), outcome in zip(draining, outcomes, strict=False):
            if isinstance(outcome, BaseException):
                self.registry.cancel_unload(entry)
                holders = ", ".join(sorted(entry.holders))
                results[i] = _failed(
                    entry.name,
                    f"adapter {entry.name!r} still has requests in flight after {timeout_s:g} s: {holders}",
                    "busy",
                )
            else:
                drained.append((i, entry))
        if drained:
            async with self.registry.update_lock:
                await self._drop([e for _, e in drained])
            for i, entry in drained:
                results[i] = LoRAAdapterResult(lora_name=entry.name, success=True, lora_id=entry.lora_id)
        for r in results:
            self.metrics.on_adapter_op("unload", r.success)
            logger.info(
                "unload adapter %s %s%s",
                r.lora_name,
                "ok" if r.success else "FAILED",
                "" if r.success else f": {r.error_message}",
            )
        self.metrics.set_resident(len(self.registry.live()))
        return _merge(UnloadLoRAAdapterReqOutput, results, self.registry.loaded_adapters())


def _failed(name: str, message: str, kind: str) -> LoRAAdapterResult:
    return LoRAAdapterResult(lora_name=name, success=False, error_message=message, error_kind=kind)


def _merge(output_type: type, results: list[LoRAAdapterResult], loaded: dict[str, str]) -> Any:
    ok = all(r.success for r in results)
    message = "; ".join(r.error_message for r in results if not r.success)
    return output_type(success=ok, error_message=message, results=results, loaded_adapters=loaded)
