"""A mix's weights from its adapters' whole PEFT tensors, computed once in the frontend and loaded like any adapter
from tensors (so every TP rank cuts its shard of the same result).

- `linear`: the weighted sum of the adapters' deltas, exactly: ranks stacked, A = cat(w_i · s_i · A_i), B = cat(B_i)
  (s_i: adapter i's scaling of that module), so B·A = Σ w_i · s_i · B_i·A_i; PEFT's add_weighted_adapter with
  combination_type "cat". No dense copy is made.
- `ties`, `dare_linear`: PEFT's combinations of the same names, on A and on B apart, each weighted by
  ±sqrt(|w_i · s_i|) (the sign on A): TIES keeps each tensor's `density` share of largest magnitudes, then, per
  entry, the weighted values whose sign agrees with that of the (unweighted) sum, averaged over how many agree;
  DARE keeps each entry with probability `density` (rescaled by 1 / density) and sums. Every adapter has the same
  rank, which is the mix's. DARE draws its masks from a generator seeded with `seed`, module by module in the model's
  order, A's masks (adapter order) then B's: PEFT's draws when torch's global generator is seeded with `seed` as its
  combination begins (add_weighted_adapter first draws the new adapter's initial weights from it).

The result's scaling is 1 (lora_alpha = r, no rsLoRA)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from loraplex.protocol.adapters.adapter_config import AdapterConfig
from loraplex.protocol.adapters.lora_targets import ALL_TARGETS

MERGES = ("linear", "ties", "dare_linear")
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<side>[AB])\.weight$")
_PEFT_PREFIX = "base_model.model."


class MixMergeError(ValueError):
    """Adapters that cannot be mixed this way; the message says why."""


def module_names(tensors: dict[str, Any]) -> list[str]:
    """The LoRA modules of a PEFT state dict (keys up to `.lora_A.weight`), in the model's module order."""
    modules = set()
    for key in tensors:
        found = _LORA_KEY.match(key)
        if found is None:
            raise MixMergeError(f"tensor {key!r} is not a LoRA A or B weight: only plain LoRA adapters mix")
        modules.add(found["module"])
    return sorted(modules, key=_module_order)


def _module_order(module: str) -> tuple:
    """Layer by layer, and within a layer in ALL_TARGETS order (HF's module order: attention, then the MLP)."""
    parts = module.split(".")
    layer = next((int(p) for p in parts if p.isdigit()), -1)
    name = parts[-1]
    return (layer, ALL_TARGETS.index(name) if name in ALL_TARGETS else len(ALL_TARGETS), module)


def merge(adapters: Sequence[tuple[AdapterConfig, dict[str, Any]]], weights: Sequence[float], how: str,
          density: float, seed: int) -> tuple[dict, dict[str, Any]]:  # fmt: skip
    """(adapter_config.json content, PEFT state dict) of the mix of `adapters` (config, whole tensors by PEFT key)."""
    import torch

    if how not in MERGES:
        raise MixMergeError(f"merge {how!r}: choose one of {', '.join(MERGES)}")
    modules = module_names(adapters[0][1])
    for _, tensors in adapters[1:]:
        if module_names(tensors) != modules:
            raise MixMergeError("the adapters target different modules")
    generator = torch.Generator().manual_seed(seed)
    merged: dict[str, Any] = {}
    ranks: dict[str, int] = {}
    for module in modules:
        a_list = [tensors[f"{module}.lora_A.weight"].float() for _, tensors in adapters]  # (r_i, in) each
        b_list = [tensors[f"{module}.lora_B.weight"].float() for _, tensors in adapters]  # (out, r_i) each
        scaled = [w * _scaling(config, module) for (config, _), w in zip(adapters, weights, strict=True)]
        if how == "linear":
            lora_a = torch.cat([a * s for a, s in zip(a_list, scaled, strict=True)])  # (Σ r_i, in)
            lora_b = torch.cat(b_list, dim=1)  # (out, Σ r_i)
        else:
            if len({a.shape[0] for a in a_list}) != 1:
                raise MixMergeError(f"{how} mixes adapters of one rank; module {module!r} has ranks "
                                    f"{[a.shape[0] for a in a_list]}")  # fmt: skip
            roots = [math.sqrt(abs(s)) for s in scaled]
            weights_a = torch.tensor([r if s >= 0 else -r for r, s in zip(roots, scaled, strict=True)])
            weights_b = torch.tensor(roots)
            combine = _ties if how == "ties" else _dare_linear
            lora_a = combine(a_list, weights_a, density, generator)
            lora_b = combine(b_list, weights_b, density, generator)
        merged[f"{module}.lora_A.weight"], merged[f"{module}.lora_B.weight"] = lora_a, lora_b
        ranks[module] = lora_a.shape[0]
    rank = max(ranks.values())
    short = {re.escape(m.removeprefix(_PEFT_PREFIX)): r for m, r in ranks.items() if r != rank}
    first = adapters[0][0]
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}),
        "use_rslora": False,
        "rank_pattern": short,
        "alpha_pattern": dict(short),  # scaling 1 in every module
        "base_model_name_or_path": first.base_model_name_or_path,
    }
    return config, merged


def _scaling(config: AdapterConfig, module: str) -> float:
    return config.module_scale(*config.module_rank_alpha(module.removeprefix(_PEFT_PREFIX)))


def _ties(tensors: list, weights, density: float, generator) -> Any:
    """TIES: each tensor's top `density` share by magnitude, weighted; entries against the majority sign (of the
    weighted sum) dropped; the rest averaged over how many remain."""
    import torch

    kept = []
    for t in tensors:
        flat = t.reshape(-1)
        mask = torch.zeros_like(flat)
        if density < 1:
            mask[torch.topk(flat.abs(), k=int(density * flat.numel())).indices] = 1
        else:
            mask += 1
        kept.append(t * mask.view(t.shape))
    stacked = torch.stack(kept)  # (adapters, ...)
    agrees = stacked.sign() == torch.where(stacked.sum(dim=0) >= 0, 1.0, -1.0)  # the sign of the unweighted sum
    weighted = stacked * weights.view(-1, *[1] * tensors[0].dim())
    return (weighted * agrees).sum(dim=0) / agrees.sum(dim=0).clamp(min=1)


def _dare_linear(tensors: list, weights, density: float, generator) -> Any:
    """DARE: each entry kept with probability `density` and rescaled by 1 / density, then the weighted sum."""
    import torch

    if density < 1:
        tensors = [t * torch.bernoulli(torch.full_like(t, density), generator=generator) / density for t in tensors]
    stacked = torch.stack(tensors) * weights.view(-1, *[1] * tensors[0].dim())
    return stacked.sum(dim=0)
