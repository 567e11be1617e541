"""The tests' adapter set, outside conftest.py so that scripts/gpu_check can use it without pytest."""

from __future__ import annotations

from loraplex.protocol.adapters.lora_targets import ATTN_MODULES, MLP_MODULES, TARGET_MODULES

# name -> (r, lora_alpha, target_modules, use_rslora); ranks and target sets deliberately differ.
ADAPTER_SPECS: dict[str, tuple[int, float, tuple[str, ...], bool]] = {
    "a4": (4, 8, ATTN_MODULES, False),
    "a8": (8, 16, MLP_MODULES, False),
    "a16": (16, 16, TARGET_MODULES, True),
    "a32": (32, 64, ("q_proj", "v_proj"), False),
    "a64": (64, 128, TARGET_MODULES, False),
}
