"""Mixtral: Llama's attention (Mistral's), and a sparse MoE block in place of the MLP of every layer (softmax router,
top-k renormalised). Published checkpoints name the block `block_sparse_moe` (worker/loader.py maps it to `mlp`)."""

from __future__ import annotations

from loraplex.worker.layers.moe import SparseMoeBlock
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from torch import nn


def make_moe_mlp(config: ModelConfig, layer_id: int) -> nn.Module:
    """The layer's MLP: the MoE block, or a dense MLP where the config keeps this layer dense."""
    moe = config.moe
    if moe is None or layer_id in moe.dense_layers:
        return LlamaMLP(config)
    return SparseMoeBlock(config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize)


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_id: int) -> nn.Module:
        return make_moe_mlp(config, layer_id)


class MixtralForCausalLM(LlamaForCausalLM):
    decoder_layer = MixtralDecoderLayer
