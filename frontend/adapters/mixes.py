"""AdapterMixes: a request's `lora_mix` served as an adapter of its own. A mix is named by its canonical JSON; the
first request that asks for it computes its tensors from its adapters' files (mix_merge.py) and loads them like an
adapter from tensors, so the scheduler places it in a slot, holds it for its requests and evicts it like any other.
A mix is dropped when one of its adapters is unloaded or reloaded (the next request computes it anew), and beyond
MAX_MIXES loaded, the least recently used mix that no request holds goes."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from loraplex.frontend.adapters.files import encode_tensors, read_adapter_tensors
from loraplex.frontend.adapters.mix_merge import MERGES, MixMergeError, merge
from loraplex.frontend.adapters.registry import AdapterEntry, AdapterRegistry
from loraplex.protocol.adapters.adapter_config import AdapterLoadError, parse_adapter_config
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.errors import ServerError
from loraplex.protocol.structs import LoRAAdapterResult, TensorSpec

MAX_MIXES = 16  # mixes kept loaded at once (each holds a host copy on every rank)
_FIELDS = {"adapters", "merge", "density", "seed"}


def mix_error(message: str) -> ServerError:
    return ServerError(f"invalid_lora_mix: {message}", "invalid_lora_mix")


@dataclass(frozen=True)
class LoRAMix:
    """A weighted set of loaded adapters and how they merge (a request's lora_mix, checked)."""

    weights: tuple[tuple[str, float], ...]  # (adapter name, weight), in the request's order
    merge: str
    density: float
    seed: int

    @property
    def name(self) -> str:
        """The mix as an adapter name: a digest of its canonical JSON (two requests for one mix share it)."""
        canonical = json.dumps({"adapters": list(self.weights), "merge": self.merge, "density": self.density,
                                "seed": self.seed}, separators=(",", ":"))  # fmt: skip
        return "mix-" + hashlib.sha256(canonical.encode()).hexdigest()[:16]


def parse_mix(raw: Any) -> LoRAMix:
    """A request's lora_mix object, or ServerError `invalid_lora_mix` saying what is wrong."""
    if not isinstance(raw, dict):
        raise mix_error(f"a mix is an object {{'adapters': {{name: weight}}, 'merge': ...}}, got {raw!r}")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise mix_error(f"unknown field(s) {', '.join(unknown)}; a mix takes {', '.join(sorted(_FIELDS))}")
    adapters = raw.get("adapters")
    if not isinstance(adapters, dict) or not adapters:
        raise mix_error("'adapters' must be a non-empty object of adapter name -> weight")
    for name, weight in adapters.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise mix_error(f"adapter {name!r}: the weight must be a finite number, got {weight!r}")
    how = raw.get("merge", "linear")
    if how not in MERGES:
        raise mix_error(f"merge {how!r}: choose one of {', '.join(MERGES)}")
    density = raw.get("density")
    if density is None and how == "linear":
        density = 1.0  # unused by linear
    if density is None:
        raise mix_error(f"merge {how!r} needs a 'density' in (0, 1]")
    if isinstance(density, bool) or not isinstance(density, int | float) or not 0 < density <= 1:
        raise mix_error(f"'density' must be a number in (0, 1], got {density!r}")
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise mix_error(f"'seed' must be a non-negative integer, got {seed!r}")
    weights = tuple((name, float(weight)) for name, weight in adapters.items())
    return LoRAMix(weights=weights, merge=how, density=float(density), seed=seed)


class MixLoader(Protocol):
    """What a mix needs of the AdapterManager that owns it."""

    config: ServerConfig
    registry: AdapterRegistry

    async def find(self, name: str) -> AdapterEntry | None: ...

    async def load_mix(
        self, name: str, config: dict, tensors: list[TensorSpec], buffers: list
    ) -> LoRAAdapterResult: ...

    async def unload_mixes(self, names: list[str]) -> None: ...


class AdapterMixes:
    """The mixes loaded as adapters: mix name -> the ids of the adapters it was computed from."""

    def __init__(self, manager: MixLoader):
        self.manager = manager
        # mix name -> its adapters' ids when it was computed, least recently used first
        self.sources: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._lock = asyncio.Lock()  # one mix computed at a time: two requests for one mix compute it once

    async def resolve(self, mix: LoRAMix) -> str:
        """The adapter name serving `mix`, computed and loaded on its first use; ServerError invalid_lora_mix."""
        manager = self.manager
        limit = manager.config.max_loras_per_batch
        if len(mix.weights) > limit:
            raise mix_error(f"{len(mix.weights)} adapters: a mix takes at most --max-loras-per-batch ({limit})")
        async with self._lock:
            entries = []
            for adapter, _ in mix.weights:
                entry = await manager.find(adapter)
                if entry is None or adapter in self.sources:
                    raise mix_error(f"adapter {adapter!r} is not loaded")
                if entry.dora:
                    raise mix_error(f"adapter {adapter!r} is a DoRA adapter: a mix sums plain LoRA deltas")
                if entry.path is None:
                    raise mix_error(f"adapter {adapter!r} was loaded from tensors: a mix reads its adapters' files")
                if entry.vocabulary is not None:
                    raise mix_error(f"adapter {adapter!r} has a tokenizer of its own: a mix is encoded and decoded "
                                    "with the base model's")
                entries.append(entry)
            ids = {entry.name: entry.lora_id for entry in entries}
            name = mix.name
            if self.sources.get(name) == ids and manager.registry.get(name) is not None:
                self.sources.move_to_end(name)
                return name
            if name in self.sources:  # computed from adapters since reloaded
                await self._drop([name])
            loop = asyncio.get_running_loop()
            try:
                config, tensors = await loop.run_in_executor(None, _compute, mix, entries)
            except (MixMergeError, AdapterLoadError) as e:
                raise mix_error(str(e)) from e
            specs, buffers = encode_tensors(tensors)
            result = await manager.load_mix(name, config, specs, buffers)
            if not result.success:
                raise mix_error(result.error_message)
            self.sources[name] = ids
            idle = [n for n in self.sources if n != name and not getattr(manager.registry.get(n), "holders", None)]
            await self._drop(idle[: max(len(self.sources) - MAX_MIXES, 0)])
            return name

    async def drop_using(self, names: set[str]) -> None:
        """Unload every mix of these adapters (they were unloaded or reloaded)."""
        async with self._lock:
            await self._drop([mix for mix, ids in self.sources.items() if names & set(ids)])

    async def _drop(self, names: list[str]) -> None:
        for name in names:
            self.sources.pop(name, None)
        if names:
            await self.manager.unload_mixes(names)


def _compute(mix: LoRAMix, entries: list) -> tuple[dict, dict]:
    """(adapter_config.json content, PEFT tensors) of the mix, from its adapters' files."""
    parts = []
    for entry in entries:
        raw_config, tensors = read_adapter_tensors(entry.resolved_path, entry.root, entry.name)
        parts.append((parse_adapter_config(raw_config), tensors))
    return merge(parts, [weight for _, weight in mix.weights], mix.merge, mix.density, mix.seed)
