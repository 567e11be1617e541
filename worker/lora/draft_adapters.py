"""DraftAdapters: speculative decoding's draft-model adapters, in the draft model's own pool, whose slots mirror the
target's: draft slot s holds the draft adapter of the target adapter in target slot s, or nothing.

A target adapter's draft adapter is the one loaded with it (its load's `draft_lora_path`: host copy under the target's
lora_id, dropped with it), else the --speculative-lora-modules adapter of its name (loaded at start, kept for the
run). They run through the same LoRAManager and batched LoRA path as the target's adapters. The draft model is whole on
every rank (worker/draft_model.py), so the adapters are too: loaded unsliced (tp_size 1)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec
import torch
from loraplex.kernels import LoRABackend
from loraplex.protocol.adapters.adapter_config import AdapterLoadError, parse_adapter_config
from loraplex.protocol.adapters.adapter_files import AdapterFiles
from loraplex.protocol.adapters.lora_targets import ALL_TARGETS
from loraplex.protocol.config import LoRASource, ServerConfig
from loraplex.protocol.structs import AdapterOutcome, AdapterToLoad, ForwardReq, SlotLoad
from loraplex.worker.lora.adapter import LoRAAdapter
from loraplex.worker.lora.manager import LoRAManager
from loraplex.worker.model.config import ModelConfig, ModelConfigError
from torch import nn

logger = logging.getLogger(__name__)

# Host-copy ids of the start-up draft adapters, above any lora_id the frontend mints (it counts from 0): the run-time
# ones are kept under their target's lora_id.
STARTUP_ID_BASE = 1 << 62


class DraftAdapters:
    def __init__(self, model: nn.Module, model_config: ModelConfig, config: ServerConfig, sources: list[LoRASource],
                 target: LoRAManager, device: torch.device, dtype: torch.dtype,
                 backend: LoRABackend) -> None:  # fmt: skip
        """Wrap the draft model's linears in a pool of the target's slot count, sized for the target's rank and
        modules and the start-up draft adapters'; load every source; ModelConfigError naming one that does not."""
        parsed = []
        for source in sources:
            try:
                files = AdapterFiles.under(source.lora_name, config.lora_path_root)
                parsed.append(parse_adapter_config(files.read_config(source.lora_path)))
            except AdapterLoadError as e:
                raise ModelConfigError(f"draft adapter {source.lora_name!r}: {e}") from e
        wanted = {m for a in parsed for m in a.target_modules} | set(target.spec.target_modules)
        pool_config = msgspec.structs.replace(
            config, max_lora_rank=max([target.spec.max_lora_rank] + [a.max_rank for a in parsed]),
            max_loras_per_batch=target.num_slots, lora_target_modules=[m for m in ALL_TARGETS if m in wanted],
            enable_expert_parallel=False, enable_tower_connector_lora=False,
        )  # fmt: skip
        self.target = target  # read only: which target adapter sits in each slot, and its name
        self.manager = LoRAManager(model, model_config, pool_config, 0, 1, device, dtype, backend)
        self.manager.warmup()
        specs = [AdapterToLoad(lora_id=STARTUP_ID_BASE + i, lora_name=s.lora_name, lora_path=s.lora_path,
                               root=config.lora_path_root) for i, s in enumerate(sources)]  # fmt: skip
        for spec, outcome in zip(specs, self.manager.load(specs), strict=True):
            if not outcome.success:
                raise ModelConfigError(f"draft adapter {spec.lora_name!r}: {outcome.error_message}")
        self.startup_ids = {spec.lora_name: spec.lora_id for spec in specs}
        if specs:
            logger.info("draft adapters: %s", ", ".join(self.startup_ids))

    # ---- run-time draft adapters, loaded and dropped with their target adapters -------------------------------
    # The loader's thread calls read, install (before the targets install, so a draft that fails refuses its target)
    # and forget_failed (after); the main loop calls drop. A draft copy is a dict insert under a new lora_id, which no
    # pass refers to before the target's slot load names it.

    def read(self, adapters: Sequence[AdapterToLoad], outcomes: list[LoRAAdapter | AdapterLoadError],
             ) -> tuple[list[LoRAAdapter | AdapterLoadError], dict[int, LoRAAdapter]]:  # fmt: skip
        """The draft adapters of the adapters whose own read succeeded (any thread), by target lora_id; and
        `outcomes` (the targets' reads) with each target whose draft adapter fails refused, naming it."""
        drafted = [a for a, o in zip(adapters, outcomes, strict=True)
                   if a.draft_lora_path is not None and isinstance(o, LoRAAdapter)]  # fmt: skip
        specs = [_as_draft(a) for a in drafted]
        pending: dict[int, LoRAAdapter] = {}
        refused: dict[int, AdapterLoadError] = {}
        for spec, draft in zip(specs, self.manager.read(specs), strict=True):
            if isinstance(draft, AdapterLoadError):
                refused[spec.lora_id] = AdapterLoadError(f"adapter {spec.lora_name!r}: its draft adapter "
                                                         f"(draft_lora_path {spec.lora_path}): {draft}", draft.kind)
            else:
                pending[spec.lora_id] = draft
        return [refused.get(a.lora_id, o) for a, o in zip(adapters, outcomes, strict=True)], pending

    def install(self, adapters: Sequence[AdapterToLoad], outcomes: list[LoRAAdapter | AdapterLoadError],
                pending: dict[int, LoRAAdapter]) -> list[LoRAAdapter | AdapterLoadError]:  # fmt: skip
        """Keep the draft copies `read` gave; `outcomes` with each target whose draft copy does not install refused."""
        results = list(outcomes)
        for i, adapter in enumerate(adapters):
            draft = pending.get(adapter.lora_id)
            if draft is None:
                continue
            [installed] = self.manager.install([_as_draft(adapter)], [draft])
            if not installed.success:
                results[i] = AdapterLoadError(f"adapter {adapter.lora_name!r}: its draft adapter: "
                                              f"{installed.error_message}", installed.error_kind or "invalid")
        return results

    def forget_failed(self, outcomes: Sequence[AdapterOutcome]) -> None:
        """The draft copies of the targets that did not install (all or nothing)."""
        self.drop([o.lora_id for o in outcomes if not o.success])

    def drop(self, lora_ids: Sequence[int]) -> None:
        """The draft adapters of these target adapters (where they have one of their own), emptying their slots."""
        own = [lora_id for lora_id in lora_ids if lora_id in self.manager.adapters]
        if own:
            self.manager.drop(own)

    # ---- slots and batches -------------------------------------------------------------------------------------

    def _draft_id(self, target_lora_id: int) -> int:
        """The host copy that drafts for a target adapter: its own, else its name's start-up one; -1: none."""
        if target_lora_id == -1:
            return -1
        if target_lora_id in self.manager.adapters:
            return target_lora_id
        return self.startup_ids.get(self.target.names.get(target_lora_id), -1)

    def bind(self, reqs: Sequence[ForwardReq]) -> list[ForwardReq]:
        """The requests on the draft's slots, after the draft slots follow the target's (call once the pass's target
        slot loads are applied): a request keeps its slot where its adapter has a draft adapter, else runs on the
        bare draft model (-1). The target's batch is sorted by its slots, so it is by the draft's too."""
        loads = []
        for slot, target_id in enumerate(self.target.slot_lora_ids):
            wanted = self._draft_id(target_id)
            if self.manager.slot_lora_ids[slot] != wanted:
                loads.append(SlotLoad(slot=slot, lora_id=wanted))
        self.manager.apply_slot_loads(loads)
        slots = [req.slot if req.slot != -1 and self.manager.slot_lora_ids[req.slot] != -1 else -1 for req in reqs]
        return [req if req.slot == slot else msgspec.structs.replace(req, slot=slot)
                for req, slot in zip(reqs, slots, strict=True)]  # fmt: skip

    def prepare(self, reqs: Sequence[ForwardReq], last_rows: torch.Tensor) -> None:
        """This draft forward's segments (reqs already bound), the LM head's rows among its tokens."""
        self.manager.prepare(reqs)
        self.manager.select_rows(last_rows)


def _as_draft(adapter: AdapterToLoad) -> AdapterToLoad:
    """A target adapter's load as its draft adapter's: the draft's files, under the target's lora_id and name."""
    return msgspec.structs.replace(adapter, lora_path=adapter.draft_lora_path, inline=None, draft_lora_path=None)
