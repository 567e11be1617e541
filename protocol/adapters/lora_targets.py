"""The one table of the linears a LoRA adapter may target: the HF module names adapters use, in the order every
list of them is kept, and how tensor parallelism splits each. The frontend, the workers and the demo builders all
read it here."""

from __future__ import annotations

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = ATTN_MODULES + MLP_MODULES
# Latent attention's own linears (DeepSeek-V3; its o_proj, and q_proj where q_lora_rank is null, are the ones above).
# A model without them builds no pool for them.
MLA_MODULES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
# Hybrid models' linear-attention (Gated DeltaNet) layers, Qwen3.5's names. Its in_proj_qkv is fused q | k | v (a
# FUSED_TARGETS entry below): the slices are named in_proj_q / in_proj_k / in_proj_v here, each cut on its own by TP.
LINEAR_ATTN_MODULES = ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
LAYER_MODULES = TARGET_MODULES + MLA_MODULES + LINEAR_ATTN_MODULES  # every linear of a decoder layer ("all")

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
    # the latent down-projections are whole on every rank (A and B kept whole); the up-projections split by head
    "q_a_proj": "replicated",
    "q_b_proj": "column",
    "kv_a_proj_with_mqa": "replicated",
    "kv_b_proj": "column",
    "in_proj_q": "column",
    "in_proj_k": "column",
    "in_proj_v": "column",
    "in_proj_z": "column",
    "in_proj_b": "column",
    "in_proj_a": "column",
    "out_proj": "row",
}
assert tuple(TP_MODES) == LAYER_MODULES

# The layers outside the decoder layers that LoRA may target, on request (--lora-target-modules; "all" means the
# layers' linears above): their pool holds vocabulary-sized buffers. Replicated on every rank, so TP cuts none of
# their weights.
# PEFT names the embedding's pair lora_embedding_A (r, vocab) and lora_embedding_B (hidden, r).
MODEL_TARGETS = ("embed_tokens", "lm_head")
ALL_TARGETS = LAYER_MODULES + MODEL_TARGETS  # every target name, in the order every list of them is kept

# Modules some checkpoints store fused (Phi-3: qkv_proj, gate_up_proj), so PEFT adapters of those models target them:
# one A (r, in) and one B (sum of the slices' out, r). Each is served as one LoRA per slice, all sharing that A, with
# B cut at the slice boundaries; that is the same product, and TP then cuts each slice's B as its own (so q, k and v
# rows are each split over ranks). An adapter config naming a fused module reads as naming its slices.
FUSED_TARGETS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkv": ("in_proj_q", "in_proj_k", "in_proj_v"),
    # Qwen3-Next: stored grouped by key head (the worker regroups B's rows into slice order before the cut)
    "in_proj_qkvz": ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
assert all(set(slices) <= set(LAYER_MODULES) for slices in FUSED_TARGETS.values())

# Mixture-of-experts models: each expert's gate/up/down are the MLP modules above, per expert. Mixtral's checkpoints
# (and PEFT adapters trained on them) name them w1/w3/w2; PEFT's `target_parameters` form names the stacked tensors of
# transformers 5 (`mlp.experts.gate_up_proj`: gate and up fused, `mlp.experts.down_proj`).
EXPERT_MODULE_ALIASES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# BERT's module names (PEFT's target_modules for an encoder) -> the ones above that serve them: an encoder layer's
# attention.self.query/key/value, attention.output.dense, intermediate.dense and output.dense. As PEFT matches a name
# at the end of a module's path, `output.dense` reaches both output denses and `dense` every one (the pooler's too,
# whose tensors are then refused by name).
ENCODER_MODULE_ALIASES = {
    "query": ("q_proj",),
    "key": ("k_proj",),
    "value": ("v_proj",),
    "attention.output.dense": ("o_proj",),
    "intermediate.dense": ("up_proj",),
    "output.dense": ("o_proj", "down_proj"),
    "dense": ("o_proj", "up_proj", "down_proj"),
}
# An encoder layer's module path in an adapter's tensor names -> the module it is here
ENCODER_MODULE_PATHS = {
    "attention.self.query": "q_proj",
    "attention.self.key": "k_proj",
    "attention.self.value": "v_proj",
    "attention.output.dense": "o_proj",
    "intermediate.dense": "up_proj",
    "output.dense": "down_proj",
}
EXPERT_PARAMETERS = {"experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",)}
