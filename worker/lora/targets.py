"""The linears LoRA can target: the HF module names adapters use, and where each lives in our fused layers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from loraplex.protocol.adapters.lora_targets import ATTN_MODULES, LAYER_MODULES, LINEAR_ATTN_MODULES, TP_MODES
from loraplex.worker.model.config import ModelConfig


@dataclass(frozen=True)
class FusedLinear:
    name: str  # attribute path inside a decoder layer
    # the HF modules fused into it, in slice order (see worker/loader.py FUSED_SLICES); a shared expert's are named
    # `shared_experts.` + module, as an adapter's weights are keyed, apart from the routed experts' of the same layer
    slices: tuple[str, ...]

    @property
    def modules(self) -> tuple[str, ...]:
        """The HF module names an adapter config targets (target_modules) to reach the slices."""
        return tuple(name.rpartition(".")[2] for name in self.slices)

    @property
    def tp_mode(self) -> str:
        """'column', 'row' or 'replicated': the one rule of protocol/adapters/lora_shards.py, which cuts its adapters'
        weights."""
        return TP_MODES[self.modules[0]]


FUSED_LINEARS = (
    FusedLinear("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
    FusedLinear("self_attn.o_proj", ("o_proj",)),
    FusedLinear("mlp.gate_up_proj", ("gate_proj", "up_proj")),
    FusedLinear("mlp.down_proj", ("down_proj",)),
    FusedLinear("mlp.up_proj", ("up_proj",)),  # an MLP without a gate (BERT's intermediate.dense)
    # latent attention (worker/model/deepseek_v3.py); kv_b_proj's wrapper is worker/lora/latent.py's
    FusedLinear("self_attn.q_a_proj", ("q_a_proj",)),
    FusedLinear("self_attn.q_b_proj", ("q_b_proj",)),
    FusedLinear("self_attn.kv_a_proj_with_mqa", ("kv_a_proj_with_mqa",)),
    FusedLinear("self_attn.kv_b_proj", ("kv_b_proj",)),
    FusedLinear("self_attn.q_proj", ("q_proj",)),  # latent attention's own, where q_lora_rank is null; Gemma 4's
    # Gemma 4's unfused k and v (a KV-shared layer has neither, a layer whose values are its keys no v_proj)
    FusedLinear("self_attn.k_proj", ("k_proj",)),
    FusedLinear("self_attn.v_proj", ("v_proj",)),
    # a hybrid model's linear-attention layers (worker/model/qwen3_5.py)
    FusedLinear("linear_attn.in_proj_qkv", ("in_proj_q", "in_proj_k", "in_proj_v")),
    FusedLinear("linear_attn.in_proj_z", ("in_proj_z",)),
    FusedLinear("linear_attn.in_proj_b", ("in_proj_b",)),
    FusedLinear("linear_attn.in_proj_a", ("in_proj_a",)),
    FusedLinear("linear_attn.out_proj", ("out_proj",)),
    # Qwen3-Next's fused, grouped projections (worker/model/qwen3_next.py)
    FusedLinear("linear_attn.in_proj_qkvz", ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z")),
    FusedLinear("linear_attn.in_proj_ba", ("in_proj_b", "in_proj_a")),
)
# An MoE layer's experts: the MLP modules of every expert, stacked (worker/layers/moe.py's ExpertsLinear). A layer has
# either the dense MLP's linears or these.
EXPERT_FUSED_LINEARS = (
    FusedLinear("mlp.experts.gate_up_proj", ("gate_proj", "up_proj")),
    FusedLinear("mlp.experts.down_proj", ("down_proj",)),
)
# A shared expert: one dense MLP beside the routed experts of an MoE layer, DeepSeek-V3's (and Llama 4's, renamed at
# load) `mlp.shared_experts.*` and Qwen3-Next's / Qwen3.5-MoE's `mlp.shared_expert.*` (a layer has one or neither). Its
# modules are named SHARED_PREFIX + module whichever the parent (worker/lora/adapter.py reads the adapter's name
# against MoEConfig.shared_expert_name), so one adapter table serves both; the sigmoid gate that scales Qwen's
# (`shared_expert_gate`, one output per token) is a router, not a LoRA target.
SHARED_PREFIX = "shared_experts."
SHARED_PARENTS = ("shared_experts", "shared_expert")
SHARED_FUSED_LINEARS = tuple(
    fused
    for parent in SHARED_PARENTS
    for fused in (
        FusedLinear(f"mlp.{parent}.gate_up_proj", (SHARED_PREFIX + "gate_proj", SHARED_PREFIX + "up_proj")),
        FusedLinear(f"mlp.{parent}.down_proj", (SHARED_PREFIX + "down_proj",)),
    )
)
# HF module -> (the experts' fused linear, slice index) in an MoE layer
EXPERT_SLICE_OF: dict[str, tuple[FusedLinear, int]] = {
    module: (fused, slice_id) for fused in EXPERT_FUSED_LINEARS for slice_id, module in enumerate(fused.slices)
}
# HF module -> the fused linears of any layer that may hold it (what an adapter targeting it activates); a layer has
# one of each module's (q_proj: a Llama layer's qkv_proj or latent attention's own q_proj; gate_proj: the dense MLP's,
# or the experts' and the shared experts')
KINDS_OF: dict[str, tuple[str, ...]] = {
    module: tuple(fused.name for fused in (*FUSED_LINEARS, *EXPERT_FUSED_LINEARS, *SHARED_FUSED_LINEARS)
                  if module in fused.modules)
    for module in LAYER_MODULES
}
assert all(KINDS_OF.values())  # every module of the one table has its place here
# Fused targets whose B rows a checkpoint groups by key head (Qwen3-Next): regrouped into slice order before the split
GROUPED_TARGETS = ("in_proj_qkvz", "in_proj_ba")


def slice_order_rows(config: ModelConfig, fused: str, lora_b: torch.Tensor) -> torch.Tensor:
    """A fused target's B (out, r) with its rows in slice order (lora_targets.FUSED_TARGETS): Qwen3-Next's grouped
    projections regrouped as their weights are (worker/model/qwen3_next.py), any other as it is."""
    if fused not in GROUPED_TARGETS:
        return lora_b
    from loraplex.worker.model.qwen3_next import ungroup_rows  # the one regrouping, the weights' too

    la = config.linear_attention
    sizes = [la.key_dim, la.key_dim, la.value_dim, la.value_dim] if fused == "in_proj_qkvz" else \
        [la.num_value_heads, la.num_value_heads]  # fmt: skip
    return ungroup_rows(lora_b, la.num_key_heads, sizes)


def layer_has_module(config: ModelConfig, layer: int, module: str) -> bool:
    """Whether decoder layer `layer` has `module`: a hybrid model's linear-attention layers have no softmax
    attention projections, its attention layers none of the linear-attention ones; a plain model has none of those."""
    la = config.linear_attention
    if module in LINEAR_ATTN_MODULES:
        return la is not None and layer in la.layer_ids
    g4 = config.gemma4
    if g4 is not None and module in ("k_proj", "v_proj"):  # a KV-shared layer projects queries alone
        return not g4.is_kv_shared(layer) and not (module == "v_proj" and g4.values_are_keys[layer])
    if module in ATTN_MODULES:
        return la is None or layer not in la.layer_ids
    return True


def is_expert_module(model_config: ModelConfig, layer: int, module: str) -> bool:
    """Whether `module` of `layer` is the experts' (stacked, one per expert) rather than a dense linear."""
    moe = model_config.moe
    return moe is not None and module in EXPERT_SLICE_OF and layer not in moe.dense_layers


def full_shapes(config: ModelConfig, layer: int | None = None) -> dict[str, tuple[int, int]]:
    """HF module -> (in_features, out_features) of its full, unsharded weight (the embedding's: as a linear from
    one-hot tokens); `experts.` + module: one expert's; `shared_experts.` + module: the shared experts' MLP's.
    `layer`: that layer's, where layers differ (Gemma 4's head widths and MLP widths); None: every module's name."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    expert_inter = config.moe.intermediate_size if config.moe is not None else inter
    shared_inter = config.moe.shared_intermediate_size if config.moe is not None else 0
    g4 = config.gemma4
    if g4 is not None and layer is not None:
        q_size, kv_size = config.num_heads * g4.head_dims[layer], g4.kv_heads[layer] * g4.head_dims[layer]
        inter = g4.mlp_sizes[layer]
        shared_inter = inter if shared_inter else 0
    shared_shapes = {SHARED_PREFIX + "gate_proj": (hidden, shared_inter),
                     SHARED_PREFIX + "up_proj": (hidden, shared_inter),
                     SHARED_PREFIX + "down_proj": (shared_inter, hidden)} if shared_inter else {}  # fmt: skip
    mla = config.mla
    if mla is not None:
        q_size = config.num_heads * mla.qk_head_dim
        latent_shapes = {
            "kv_a_proj_with_mqa": (hidden, mla.cache_dim),
            "kv_b_proj": (mla.kv_lora_rank, config.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)),
        }
        if mla.q_lora_rank is not None:
            latent_shapes.update(q_a_proj=(hidden, mla.q_lora_rank), q_b_proj=(mla.q_lora_rank, q_size))
    else:
        latent_shapes = {}
    o_in = q_size if mla is None else config.num_heads * mla.v_head_dim
    # Latent attention has no k/v projections, and q_proj only where q_lora_rank is null (then q_a/q_b are absent).
    absent: tuple[str, ...] = ()
    if mla is not None:
        absent = ("k_proj", "v_proj") if mla.q_lora_rank is None else ("q_proj", "k_proj", "v_proj")
    la = config.linear_attention
    linear_shapes = {} if la is None else {
        "in_proj_q": (hidden, la.key_dim),
        "in_proj_k": (hidden, la.key_dim),
        "in_proj_v": (hidden, la.value_dim),
        "in_proj_z": (hidden, la.value_dim),
        "in_proj_b": (hidden, la.num_value_heads),
        "in_proj_a": (hidden, la.num_value_heads),
        "out_proj": (la.value_dim, hidden),
    }
    q_out = 2 * q_size if la is not None else q_size  # a hybrid model's gated attention: q_proj yields q | gate
    shapes = {
        **latent_shapes,
        **linear_shapes,
        "experts.gate_proj": (hidden, expert_inter),
        "experts.up_proj": (hidden, expert_inter),
        "experts.down_proj": (expert_inter, hidden),
        **shared_shapes,
        "q_proj": (hidden, q_out),
        "k_proj": (hidden, kv_size),
        "v_proj": (hidden, kv_size),
        "o_proj": (o_in, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
        "embed_tokens": (config.vocab_size, hidden),  # lora_embedding_A (r, vocab), lora_embedding_B (hidden, r)
        "lm_head": (hidden, config.vocab_size),
    }
    return {module: shape for module, shape in shapes.items() if module not in absent}
