"""AdapterManager: the adapter operations (load, unload, in-place reload, first use through the resolver) and a
request's hold on its adapter, between the registry, which decides, and the ranks, which carry them out
(frontend/adapters/delivery.py). Which host copies stay loaded is HostResidency's (frontend/adapters/residency.py).

Operations are serialized by the registry's update lock; an unload waits for the adapter's requests outside the lock,
so other operations go on meanwhile. Every operation reaches every data-parallel replica and counts only where all of
them succeeded; it has a deadline (--lora-load-timeout) and is rolled back when it is missed. After each change the
state file, if any, is rewritten.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Collection

import msgspec
from loraplex.frontend.adapters.audit import SERVER, AuditLog, Caller
from loraplex.frontend.adapters.delivery import AdapterDelivery, Shipment
from loraplex.frontend.adapters.mixes import AdapterMixes
from loraplex.frontend.adapters.registry import AdapterEntry, AdapterError, AdapterRegistry
from loraplex.frontend.adapters.residency import HostResidency
from loraplex.frontend.adapters.sources import SourceError, cache_for, parse_remote, resolver_source
from loraplex.frontend.adapters.state_file import AdapterStateFile
from loraplex.frontend.adapters.tokenizers import AdapterTokenizers, Vocabulary
from loraplex.frontend.cluster.replica_set import ReplicaSet
from loraplex.frontend.metrics import Metrics
from loraplex.protocol.config import ServerConfig, is_loopback_host
from loraplex.protocol.errors import ServerError
from loraplex.protocol.structs import (
    AdapterOutcome,
    AdapterToLoad,
    InlineAdapter,
    LoadLoRAAdapterFromTensorsReqInput,
    LoadLoRAAdapterReqOutput,
    LoRAAdapterResult,
    LoRAAdapterSpec,
    TensorSpec,
    UnloadLoRAAdapterReqOutput,
)

logger = logging.getLogger("loraplex.adapters")


class AdapterManager:
    def __init__(
        self,
        config: ServerConfig,
        registry: AdapterRegistry,
        metrics: Metrics,
        replicas: ReplicaSet,
        state_file: AdapterStateFile | None = None,
        audit: AuditLog | None = None,
    ):
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.state_file = state_file
        self.cache = cache_for(config.lora_cache_dir, config.lora_cache_max_gb)  # Hub and S3 adapters land here
        registry.allow_cache(self.cache.root)
        self.audit = audit or AuditLog(None)
        self.delivery = AdapterDelivery(config, replicas, metrics)
        self.residency = HostResidency(config, registry, metrics, self.audit, self.delivery, self._localize,
                                       self._resolve)
        self.updates_refusal: tuple[str, str] | None = None  # (message, kind) once updates are closed after start-up
        self._retiring: set[asyncio.Task] = set()
        self.mixes = AdapterMixes(self)
        # adapters' own tokenizers, read against the base model's once it is up (the Runtime sets it); None: not read
        self.tokenizers: AdapterTokenizers | None = None

    # ---- the public operations ---------------------------------------------------------------------------

    async def load(self, specs: list[LoRAAdapterSpec], load_inplace: bool = False,
                   parents: dict[str, str] | None = None, caller: Caller = SERVER) -> LoadLoRAAdapterReqOutput:
        """Adapters from directories, Hub repos or S3 prefixes. `parents`: name -> the card's parent in /v1/models
        (--lora-modules' base_model_name; default the served base name)."""
        names, paths = [s.lora_name for s in specs], [s.lora_path for s in specs]
        with self.audit.operation("reload" if load_inplace else "load", names, paths, caller) as op:
            out = await self._load(specs, [None] * len(specs), None, load_inplace, parents or {})
            op.set_outcome(out.results)
        if load_inplace:
            await self.mixes.drop_using({r.lora_name for r in out.results if r.success})
        return out

    async def load_from_tensors(self, request: LoadLoRAAdapterFromTensorsReqInput, buffers: list,
                                caller: Caller = SERVER) -> LoadLoRAAdapterReqOutput:
        """An adapter from tensors in memory: `buffers` hold the bytes of `request.tensors`, in order. It has no
        path, so it is never written to the state file and never evicted (it could not be reloaded)."""
        op_name = "reload" if request.load_inplace else "load"
        with self.audit.operation(op_name, [request.lora_name], [None], caller) as op:
            if len(buffers) != len(request.tensors):
                raise ServerError(f"{len(buffers)} tensor buffers for {len(request.tensors)} tensors", "invalid")
            # lora_path is never read for an inline adapter: plan_load checks no path for it
            spec = LoRAAdapterSpec(lora_name=request.lora_name, lora_path="", pinned=request.pinned)
            inline = InlineAdapter(config=request.config_dict, tensors=request.tensors)
            out = await self._load([spec], [inline], list(buffers), request.load_inplace, {})
            op.set_outcome(out.results)
        if request.load_inplace and out.success:
            await self.mixes.drop_using({request.lora_name})
        return out

    async def load_mix(self, name: str, config: dict, tensors: list[TensorSpec], buffers: list) -> LoRAAdapterResult:
        """A request's mix (mixes.py) as an adapter from tensors. A mix is part of a request, so it loads whether or
        not run-time adapter updates are open."""
        spec = LoRAAdapterSpec(lora_name=name, lora_path="", pinned=False)
        inline = InlineAdapter(config=config, tensors=tensors)
        out = await self._load([spec], [inline], list(buffers), False, {}, check_updates=False)
        return out.results[0]

    async def unload_mixes(self, names: list[str]) -> None:
        out = await self._unload(names, check_updates=False)
        for result in out.results:
            if not result.success:
                logger.warning("mix %s stays loaded: %s", result.lora_name, result.error_message)

    async def _load(self, specs: list[LoRAAdapterSpec], inline: list[InlineAdapter | None], frames: list | None,
                    load_inplace: bool, parents: dict[str, str], check_updates: bool = True,
                    ) -> LoadLoRAAdapterReqOutput:  # fmt: skip
        """frames: the tensor bytes of the one inline adapter (load_from_tensors), or None."""
        if check_updates:
            self._check_updates_open()
        if not self.config.lora_enabled:
            results = [_failed(s.lora_name, "LoRA is not enabled (start with --enable-lora)", "invalid") for s in specs]
            return _merge(LoadLoRAAdapterReqOutput, results, {})
        # Downloads happen before the update lock, so other operations go on meanwhile.
        local_specs = [spec if content is not None else await self._localize_spec(spec)
                       for spec, content in zip(specs, inline, strict=True)]
        local_specs = [self._check_draft(spec) for spec in local_specs]
        async with self.registry.update_lock:
            planned = self._plan(local_specs, inline, load_inplace)
            vocabularies = await self._read_vocabularies(planned)
            to_load = [p for p in planned if isinstance(p, AdapterToLoad)]
            shipments = [Shipment(a, frames if a.inline is not None and frames is not None else []) for a in to_load]
            sent = await self.delivery.load(shipments, "load")
            outcomes = dict(zip([a.lora_id for a in to_load], sent, strict=True))
            results = []
            for spec, plan in zip(specs, planned, strict=True):
                if isinstance(plan, AdapterError):
                    results.append(_failed(spec.lora_name, str(plan), plan.kind))
                    self.metrics.on_adapter_op("load", False)
                    logger.info("load adapter %s refused: %s", spec.lora_name, plan)
                    continue
                outcome = outcomes[plan.lora_id]
                if outcome.success:
                    client_path = None if plan.inline is not None else spec.lora_path
                    self._commit(plan, client_path, outcome, parents.get(plan.lora_name),
                                 vocabularies.get(plan.lora_id))
                results.append(_result(plan.lora_name, outcome))
            await self.residency.evict_over_limit({a.lora_name for a in to_load})
            self._save_state()
            self._count_loaded()
        return _merge(LoadLoRAAdapterReqOutput, results, self.registry.loaded_adapters())

    async def _read_vocabularies(self, planned: list[AdapterToLoad | AdapterError]) -> dict[int, Vocabulary]:
        """The own tokenizers of the planned adapters that carry one (by lora_id), read before any rank loads them;
        a plan whose tokenizer is refused becomes its AdapterError (in place)."""
        vocabularies: dict[int, Vocabulary] = {}
        if self.tokenizers is None:
            return vocabularies
        loop = asyncio.get_running_loop()
        for i, plan in enumerate(planned):
            if isinstance(plan, AdapterError) or plan.lora_path is None:
                continue  # refused already, or from tensors (no files)
            try:
                vocabulary = await loop.run_in_executor(None, self.tokenizers.read, plan.lora_name, plan.lora_path,
                                                        plan.root)  # fmt: skip
            except AdapterError as e:
                planned[i] = e
                continue
            if vocabulary is not None:
                vocabularies[plan.lora_id] = vocabulary
        return vocabularies

    def _plan(self, specs: list[LoRAAdapterSpec | AdapterError], inline: list[InlineAdapter | None],
              load_inplace: bool) -> list[AdapterToLoad | AdapterError]:
        """registry.plan_load over the specs whose files are here; the others keep their download's error."""
        ok = [i for i, spec in enumerate(specs) if not isinstance(spec, AdapterError)]
        planned = iter(self.registry.plan_load([specs[i] for i in ok], replace=load_inplace,
                                               inline=[inline[i] for i in ok]))
        return [next(planned) if i in ok else spec for i, spec in enumerate(specs)]

    def _check_draft(self, spec: LoRAAdapterSpec | AdapterError) -> LoRAAdapterSpec | AdapterError:
        """A draft_lora_path is a draft model's adapter: refused by name where no draft model runs, and across nodes
        (every rank reads it from its path)."""
        if isinstance(spec, AdapterError) or spec.draft_lora_path is None:
            return spec
        speculation = self.config.speculation
        if speculation is None or speculation.method != "draft_model":
            return AdapterError(f"adapter {spec.lora_name!r}: draft_lora_path needs a draft model "
                                "(--speculative-config method draft_model)", "invalid")  # fmt: skip
        if self.config.nnodes > 1:
            return AdapterError(f"adapter {spec.lora_name!r}: draft_lora_path is not served with --nnodes > 1",
                                "invalid")  # fmt: skip
        return spec

    async def _localize_spec(self, spec: LoRAAdapterSpec) -> LoRAAdapterSpec | AdapterError:
        if not isinstance(spec.lora_path, str):
            return spec  # plan_load words the refusal
        try:
            return msgspec.structs.replace(spec, lora_path=await self._localize(spec.lora_path))
        except SourceError as e:
            return AdapterError(f"adapter {spec.lora_name!r}: {e}", e.kind)

    async def _localize(self, path: str) -> str:
        """A Hub or S3 path's local directory in the cache (downloaded off the event loop unless it is there); a
        local path as it is. SourceError says why not."""
        source = parse_remote(path)
        if source is None:
            return path
        return await asyncio.get_running_loop().run_in_executor(None, self.cache.fetch, source)

    async def unload(self, names: list[str], caller: Caller = SERVER) -> UnloadLoRAAdapterReqOutput:
        paths = [entry.path if (entry := self.registry.get(name)) is not None else None for name in names]
        with self.audit.operation("unload", names, paths, caller) as op:
            out = await self._unload(names)
            op.set_outcome(out.results)
        await self.mixes.drop_using({r.lora_name for r in out.results if r.success})
        return out

    async def _unload(self, names: list[str], check_updates: bool = True) -> UnloadLoRAAdapterReqOutput:
        if check_updates:
            self._check_updates_open()
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
        outcomes = await asyncio.gather(
            *[asyncio.wait_for(entry.released.wait(), timeout_s) for _, entry in draining], return_exceptions=True
        )
        drained = []
        for (i, entry), outcome in zip(draining, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                self.registry.cancel_unload(entry)
                holders = ", ".join(sorted(entry.holders))
                message = f"adapter {entry.name!r} still has requests in flight after {timeout_s:g} s: {holders}"
                results[i] = _failed(entry.name, message, "busy")
            else:
                drained.append((i, entry))
                results[i] = LoRAAdapterResult(lora_name=entry.name, success=True)
        if drained:
            async with self.registry.update_lock:
                try:
                    await self._drop([entry for _, entry in drained])
                except ServerError as e:
                    for i, entry in drained:
                        results[i] = _failed(entry.name, f"adapter {entry.name!r}: {e}", e.kind)
                self._save_state()
                self._count_loaded()
        for result in results:
            self.metrics.on_adapter_op("unload", result.success)
            if result.success:
                self.metrics.drop_adapter(result.lora_name)
            logger.info("unload adapter %s %s", result.lora_name, "ok" if result.success else
                        f"FAILED: {result.error_message}")
        return _merge(UnloadLoRAAdapterReqOutput, results, self.registry.loaded_adapters())

    def check_batch(self, names: Collection[str]) -> None:
        self.residency.check_batch(names)

    async def find(self, name: str) -> AdapterEntry | None:
        """The live entry of `name`, loaded through the resolver on its first use (None: unknown, or unloading)."""
        if self.registry.get(name) is None and self.config.lora_enabled:
            await self.residency.ensure(name)
        entry = self.registry.get(name)
        return None if entry is None or entry.draining else entry

    async def hold(self, name: str, rid: str, batch: Collection[str] = ()) -> AdapterEntry:
        """Request `rid`'s hold on adapter `name`: its host copy brought back (or first loaded through the resolver)
        evicting none of `batch`, then acquired. No await lies between the two, so no eviction or unload slips in
        between. AdapterError if it cannot be had."""
        if self.config.lora_enabled:
            await self.residency.ensure(name, batch)
        entry = self.registry.get(name)
        if entry is None or entry.draining:
            raise AdapterError(f"adapter {name!r} is not loaded", kind="not_found")
        return self.registry.acquire(name, rid)

    def release(self, lora_id: int, rid: str) -> None:
        self.registry.release(lora_id, rid)

    # ---- start-up -------------------------------------------------------------------------------------------

    async def load_startup(self, specs: list[LoRAAdapterSpec], parents: dict[str, str] | None = None) -> None:
        """--lora-paths/--lora-modules (must load), then the state file's other entries (logged and skipped when
        they no longer load); under --disable-lora-updates, or beyond loopback with no key, nothing changes after
        this."""
        saved = self.state_file.read() if self.state_file is not None else []  # before any load rewrites it
        if specs:
            out = await self.load(specs, parents=parents)
            failed = [r for r in out.results if not r.success]
            if failed:
                raise RuntimeError("start-up adapters failed: " + "; ".join(r.error_message for r in failed))
        taken = {s.lora_name for s in specs}
        for spec in saved:
            if spec.lora_name in taken:
                continue
            out = await self.load([spec])
            if not out.success:
                logger.warning("state file %s: adapter %s skipped: %s", self.state_file.path, spec.lora_name,
                               out.error_message)
        self.updates_refusal = update_policy(self.config)

    # ---- the steps -------------------------------------------------------------------------------------------

    def _check_updates_open(self) -> None:
        if self.updates_refusal is not None:
            raise ServerError(*self.updates_refusal)

    def _commit(self, plan: AdapterToLoad, client_path: str | None, outcome: AdapterOutcome,
                parent: str | None = None, vocabulary: Vocabulary | None = None) -> None:
        old = self.registry.get(plan.lora_name)
        if parent is None and old is not None and plan.replaces is not None:
            parent = old.parent  # an in-place reload keeps the card's lineage
        entry = AdapterEntry(name=plan.lora_name, path=client_path, lora_id=plan.lora_id, pinned=plan.pinned,
                             resolved_path=plan.lora_path or "", root=plan.root, rank=outcome.lora_rank,
                             target_modules=list(outcome.target_modules), parent=parent,
                             dora=outcome.dora, vocabulary=vocabulary, draft_path=plan.draft_lora_path)
        replaced = self.registry.add(entry)
        if replaced is not None:  # in-place reload: the old weights go once the requests running on them finish
            task = asyncio.get_running_loop().create_task(self._retire(replaced))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _resolve(self, name: str, keep: set[str]) -> None:
        """--lora-resolver-dir: load DIR/name as adapter `name`, evicting none of `keep` (caller holds the update
        lock). A remote DIR (s3://bucket/prefix, hf://org) is fetched into the cache, which is then its root."""
        if not name or "/" in name or name.startswith(".") or "\\" in name:
            raise AdapterError(f"adapter {name!r}: not a name the resolver can look up", "invalid")
        remote = resolver_source(self.config.lora_resolver_dir, name)
        if remote is None:
            resolver_dir = os.path.realpath(self.config.lora_resolver_dir)
            client_path = path = os.path.join(resolver_dir, name)
            if not os.path.isdir(path):
                raise AdapterError(f"adapter {name!r} is not loaded and not in --lora-resolver-dir", "not_found")
        else:
            resolver_dir, client_path = None, remote
            try:
                path = await self._localize(remote)
            except SourceError as e:
                raise AdapterError(f"adapter {name!r} is not loaded, and --lora-resolver-dir: {e}", e.kind) from e
        spec = LoRAAdapterSpec(lora_name=name, lora_path=path)
        plans = self.registry.plan_load([spec], replace=False, root=resolver_dir)
        vocabularies = await self._read_vocabularies(plans)
        planned = plans[0]
        if isinstance(planned, AdapterError):
            raise AdapterError(f"adapter {name!r} from --lora-resolver-dir: {planned}", "invalid")
        outcome = (await self.delivery.load([Shipment(planned)], "load"))[0]
        if not outcome.success:
            kind = outcome.error_kind if outcome.error_kind in ("timeout", "unavailable") else "invalid"
            raise AdapterError(f"adapter {name!r} from --lora-resolver-dir: {outcome.error_message}", kind)
        self._commit(planned, client_path, outcome, vocabulary=vocabularies.get(planned.lora_id))
        await self.residency.evict_over_limit(keep)
        self._save_state()
        self._count_loaded()

    async def _retire(self, entry: AdapterEntry) -> None:
        await entry.released.wait()
        async with self.registry.update_lock:
            await self._drop([entry])

    async def _drop(self, entries: list[AdapterEntry]) -> None:
        # Forgotten first: if the scheduler misses its deadline, the drop still reaches it when it listens again,
        # and nothing may use the adapter meanwhile.
        for entry in entries:
            self.registry.forget(entry)
        await self.delivery.drop([e.lora_id for e in entries if e.resident])

    def _count_loaded(self) -> None:
        self.metrics.set_loaded(len(self.registry.live()))

    def _save_state(self) -> None:
        if self.state_file is None or self.config.disable_lora_updates:
            return  # with updates disabled the file is the operator's alone: read at start, never rewritten
        # adapters loaded from tensors have no path: they cannot be restored, so they are not saved
        specs = [LoRAAdapterSpec(lora_name=e.name, lora_path=e.path, pinned=e.pinned)
                 for e in self.registry.live() if not e.draining and e.path is not None]
        try:
            self.state_file.write(specs)
        except OSError as e:  # the change itself happened: serve on, and say the file is behind
            logger.error("state file %s not rewritten: %s", self.state_file.path, e)


def update_policy(config: ServerConfig) -> tuple[str, str] | None:
    """Whether run-time adapter updates stay open after start-up, said in the log: None if they do, else the
    (message, kind) every update is refused with."""
    if config.disable_lora_updates:
        logger.info("run-time adapter updates: off (--disable-lora-updates)")
        return "adapter updates are disabled on this server (--disable-lora-updates)", "disabled"
    if config.lora_updates_need_key:
        how = "set --api-key or --admin-api-key, or pass --allow-unauthenticated-lora-updates"
        logger.warning("run-time adapter updates: off, --host %s is not loopback and no key is set (%s)",
                       config.host, how)
        return (f"updates_disabled: run-time adapter updates are off on this server (--host {config.host} is not "
                f"loopback and no key is set; {how})"), "updates_disabled"
    logger.info("run-time adapter updates: on")
    if not is_loopback_host(config.host) and not config.lora_path_root:
        logger.warning("run-time adapter updates are on beyond loopback (--host %s) without --lora-path-root: any "
                       "directory this server can read can be loaded as an adapter", config.host)
    return None


def _failed(name: object, message: str, kind: str) -> LoRAAdapterResult:
    return LoRAAdapterResult(lora_name=name if isinstance(name, str) else "", success=False, error_message=message,
                             error_kind=kind)


def _result(name: str, outcome: AdapterOutcome) -> LoRAAdapterResult:
    if outcome.success:
        return LoRAAdapterResult(lora_name=name, success=True)
    message = outcome.error_message
    if repr(name) not in message:
        message = f"adapter {name!r}: {message}"
    return _failed(name, message, outcome.error_kind or "internal")


def _merge(output_type: type, results: list[LoRAAdapterResult], loaded: dict[str, str]):
    ok = all(r.success for r in results)
    message = "; ".join(r.error_message for r in results if not r.success)
    return output_type(success=ok, error_message=message, results=results, loaded_adapters=loaded)
