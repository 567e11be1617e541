"""Mixtral: Llama's attention (Mistral's), and a sparse MoE block in place of the MLP of every layer (softmax router,
top-k renormalised). Published checkpoints name the block `block_sparse_moe` (worker/loader.py maps it to `mlp`)."""

from __future__ import annotations

from loraplex.worker.layers.moe import SparseMoeBlock
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class MoEMLP(SparseMoeBlock):
    """The MoE block of a config's `moe` fields, for a decoder layer's `mlp_cls`."""

    def __init__(self, config: ModelConfig):
        moe = config.moe
        super().__init__(config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize)


class MixtralDecoderLayer(LlamaDecoderLayer):
    mlp_cls = MoEMLP


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel
