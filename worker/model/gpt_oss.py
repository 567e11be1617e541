"""gpt-oss: Llama's decoder with biases on q/k/v/o, attention sinks (a learned logit per head that joins each
softmax's denominator), sliding-window and full layers alternating (`layer_types`), YaRN rope, and an MoE block in
every layer: a router with a bias whose softmax runs over the top-k logits alone, and experts with biases and a
clamped SwiGLU (worker/layers/activation.py). Its checkpoints stack the experts' tensors (experts, in, out) with gate
and up interleaved, which the experts' loaders reorder (worker/layers/moe.py); the published ones store them MXFP4
(worker/quant/mxfp4.py)."""

from __future__ import annotations

from dataclasses import replace

import torch
from loraplex.worker.layers.activation import ClampedSwiGLU
from loraplex.worker.layers.attention_spec import LayerAttention
from loraplex.worker.layers.moe import MoEExperts, SparseMoeBlock, route_topk_softmax
from loraplex.worker.layers.rotary import RotaryEmbedding
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from loraplex.worker.parallel import current_tp
from torch import nn


class GptOssAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer: LayerAttention):
        super().__init__(config, rotary, layer)
        tp = current_tp()
        self.num_heads, self.tp_rank = config.num_heads, tp.rank
        self.sinks = nn.Parameter(torch.empty(config.num_heads // tp.world_size), requires_grad=False)  # this rank's
        self.sinks.weight_loader = self.sinks_loader
        self.layer = replace(self.layer, sinks=self.sinks)  # the parameter itself: loading fills what attention reads

    def full_shape(self, param: nn.Parameter, shard_id: None = None) -> tuple[int, ...]:
        return (self.num_heads,)

    def sinks_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: None) -> None:
        if tuple(loaded.shape) != (self.num_heads,):
            raise ValueError(f"sinks have shape {tuple(loaded.shape)}, expected ({self.num_heads},)")
        num_local = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * num_local, num_local))


class GptOssMoeBlock(SparseMoeBlock):
    def __init__(self, config: ModelConfig):
        moe = config.moe
        activation = ClampedSwiGLU(moe.swiglu_limit, moe.swiglu_alpha)
        experts = MoEExperts(moe.num_experts, config.hidden_size, moe.intermediate_size, activation, bias=True,
                             interleaved=moe.gate_up_interleaved)  # fmt: skip
        # Stacked (experts, in, out); transformers marks them transposed, so PEFT's adapters on them are not swapped
        # as Llama 4's are (ModelConfig.moe.stacked_in_out stays False).
        for linear in (experts.gate_up_proj, experts.down_proj):
            linear.stacked_in_out = True
        super().__init__(config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size, renormalize=False,
                         experts=experts, router_bias=True)  # fmt: skip

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route_topk_softmax(self.gate(hidden), self.top_k)


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention
    mlp_cls = GptOssMoeBlock


class GptOssModel(LlamaModel):
    layer_cls = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    model_cls = GptOssModel
