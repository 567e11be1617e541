"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) and a sparse MoE block (top-k renormalised when
norm_topk_prob), with a dense MLP of intermediate_size in the layers `mlp_only_layers` and `decoder_sparse_step`
keep dense (ModelConfig.moe.dense_layers)."""

from __future__ import annotations

from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from loraplex.worker.model.mixtral import MoEMLP
from loraplex.worker.model.qwen3 import Qwen3Attention


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention
    mlp_cls = MoEMLP


class Qwen3MoeModel(LlamaModel):
    layer_cls = Qwen3MoeDecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__(config, max_positions)
        # Layers are built alike (a layer does not know its index); the dense ones then get their dense MLP.
        for layer_id in config.moe.dense_layers:
            self.layers[layer_id].mlp = LlamaMLP(config)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3MoeModel
