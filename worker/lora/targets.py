"""The linears LoRA can target: the HF module names adapters use, and where each lives in our fused layers."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.protocol.adapters.lora_targets import TARGET_MODULES, TP_MODES
from loraplex.worker.model.config import ModelConfig


@dataclass(frozen=True)
class FusedLinear:
    name: str  # attribute path inside a decoder layer
    slices: tuple[str, ...]  # the HF modules fused into it, in slice order (see worker/loader.py FUSED_SLICES)

    @property
    def tp_mode(self) -> str:
        """'column' or 'row': the one rule of protocol/adapters/lora_shards.py, which cuts its adapters' weights."""
        return TP_MODES[self.slices[0]]


FUSED_LINEARS = (
    FusedLinear("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
    FusedLinear("self_attn.o_proj", ("o_proj",)),
    FusedLinear("mlp.gate_up_proj", ("gate_proj", "up_proj")),
    FusedLinear("mlp.down_proj", ("down_proj",)),
)
# An MoE layer's experts: the MLP modules of every expert, stacked (worker/layers/moe.py's ExpertsLinear). A layer has
# either the dense MLP's linears or these.
EXPERT_FUSED_LINEARS = (
    FusedLinear("mlp.experts.gate_up_proj", ("gate_proj", "up_proj")),
    FusedLinear("mlp.experts.down_proj", ("down_proj",)),
)
# HF module -> (its fused linear, slice index) in a dense layer
SLICE_OF: dict[str, tuple[FusedLinear, int]] = {
    module: (fused, slice_id) for fused in FUSED_LINEARS for slice_id, module in enumerate(fused.slices)
}
assert set(SLICE_OF) == set(TARGET_MODULES)  # every module of the one table has its place here
# HF module -> (the experts' fused linear, slice index) in an MoE layer
EXPERT_SLICE_OF: dict[str, tuple[FusedLinear, int]] = {
    module: (fused, slice_id) for fused in EXPERT_FUSED_LINEARS for slice_id, module in enumerate(fused.slices)
}
# HF module -> the fused linears of any layer that hold it (what an adapter targeting it activates)
KINDS_OF: dict[str, tuple[str, ...]] = {
    module: tuple(table[module][0].name for table in (SLICE_OF, EXPERT_SLICE_OF) if module in table)
    for module in TARGET_MODULES
}


def is_expert_module(model_config: ModelConfig, layer: int, module: str) -> bool:
    """Whether `module` of `layer` is the experts' (stacked, one per expert) rather than a dense linear."""
    moe = model_config.moe
    return moe is not None and module in EXPERT_SLICE_OF and layer not in moe.dense_layers


def full_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """HF module -> (in_features, out_features) of its full, unsharded weight (the embedding's: as a linear from
    one-hot tokens); `experts.` + module: one expert's."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    expert_inter = config.moe.intermediate_size if config.moe is not None else inter
    return {
        "experts.gate_proj": (hidden, expert_inter),
        "experts.up_proj": (hidden, expert_inter),
        "experts.down_proj": (expert_inter, hidden),
        "q_proj": (hidden, q_size),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (q_size, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
        "embed_tokens": (config.vocab_size, hidden),  # lora_embedding_A (r, vocab), lora_embedding_B (hidden, r)
        "lm_head": (hidden, config.vocab_size),
    }
