"""DraftAdapters: speculative decoding's draft-model adapters (--speculative-lora-modules), each in a slot of the draft
model's own small pool for the whole run, found by the name of the target adapter a request runs on.

They run through the same LoRAManager and batched LoRA path as the target's adapters. The draft model is whole on
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
from loraplex.protocol.structs import AdapterToLoad, ForwardReq, SlotLoad
from loraplex.worker.lora.manager import LoRAManager
from loraplex.worker.model.config import ModelConfig, ModelConfigError
from torch import nn

logger = logging.getLogger(__name__)


class DraftAdapters:
    def __init__(self, model: nn.Module, model_config: ModelConfig, config: ServerConfig, sources: list[LoRASource],
                 device: torch.device, dtype: torch.dtype, backend: LoRABackend) -> None:  # fmt: skip
        """Wrap the draft model's linears and load every source into a slot of its own; ModelConfigError naming the
        adapter when one does not load."""
        parsed = []
        for source in sources:
            try:
                files = AdapterFiles.under(source.lora_name, config.lora_path_root)
                parsed.append(parse_adapter_config(files.read_config(source.lora_path)))
            except AdapterLoadError as e:
                raise ModelConfigError(f"draft adapter {source.lora_name!r}: {e}") from e
        # the pool is shaped by these adapters alone: no other ever comes
        wanted = {m for a in parsed for m in a.target_modules}
        pool_config = msgspec.structs.replace(
            config, max_lora_rank=max(a.max_rank for a in parsed), max_loras_per_batch=len(sources),
            lora_target_modules=[m for m in ALL_TARGETS if m in wanted], enable_expert_parallel=False,
        )  # fmt: skip
        self.manager = LoRAManager(model, model_config, pool_config, 0, 1, device, dtype, backend)
        self.manager.warmup()
        specs = [AdapterToLoad(lora_id=slot, lora_name=s.lora_name, lora_path=s.lora_path, root=config.lora_path_root)
                 for slot, s in enumerate(sources)]  # fmt: skip
        for spec, outcome in zip(specs, self.manager.load(specs), strict=True):
            if not outcome.success:
                raise ModelConfigError(f"draft adapter {spec.lora_name!r}: {outcome.error_message}")
        self.manager.apply_slot_loads([SlotLoad(slot=spec.lora_id, lora_id=spec.lora_id) for spec in specs])
        self.slot_of = {spec.lora_name: spec.lora_id for spec in specs}
        logger.info("draft adapters: %s", ", ".join(self.slot_of))

    def bind(self, reqs: Sequence[ForwardReq], adapter_names: Sequence[str | None]) -> list[ForwardReq]:
        """The requests on the draft's slots: each target adapter's namesake, else the bare draft model (-1). The
        target's batch is sorted by its slots, so each of its segments maps to one of the draft's."""
        slots = [-1 if name is None else self.slot_of.get(name, -1) for name in adapter_names]
        return [req if req.slot == slot else msgspec.structs.replace(req, slot=slot)
                for req, slot in zip(reqs, slots, strict=True)]  # fmt: skip

    def prepare(self, reqs: Sequence[ForwardReq], last_rows: torch.Tensor) -> None:
        """This draft forward's segments (reqs already bound), the LM head's rows among its tokens."""
        self.manager.prepare(reqs)
        self.manager.select_rows(last_rows)
