"""The one table of the linears a LoRA adapter may target: the HF module names adapters use, in the order every
list of them is kept, and how tensor parallelism splits each. The frontend, the workers and the demo builders all
read it here."""

from __future__ import annotations

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTN_MODULES + MLP_MODULES

# "column": the linear's output is split over ranks, so a rank keeps some rows of B (out, r) and all of A;
# "row": its input is split (the layer all-reduces the output), so a rank keeps some columns of A (r, in) and all of B.
# Fused linears (qkv, gate_up) are column-parallel and cut slice by slice: each HF module's B is cut on its own rows,
# k_proj/v_proj on the kv heads' rows (GQA).
TP_MODES = {
    "q_proj": "column",
    "k_proj": "column",
    "v_proj": "column",
    "o_proj": "row",
    "gate_proj": "column",
    "up_proj": "column",
    "down_proj": "row",
}
assert tuple(TP_MODES) == TARGET_MODULES

# Mixture-of-experts models: each expert's gate/up/down are the MLP modules above, per expert. Mixtral's checkpoints
# (and PEFT adapters trained on them) name them w1/w3/w2; PEFT's `target_parameters` form names the stacked tensors of
# transformers 5 (`mlp.experts.gate_up_proj`: gate and up fused, `mlp.experts.down_proj`).
EXPERT_MODULE_ALIASES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
EXPERT_PARAMETERS = {"experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",)}
