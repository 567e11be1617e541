"""Qwen3.5 (text): a hybrid decoder. Most layers mix tokens with Gated DeltaNet (linear attention with a fixed-size
state per request, kept in the state slots of HybridCache); every few a gated softmax attention layer reads the paged
KV cache. Both kinds run in one pass over the flat batch. Every norm is the (1 + w) RMSNorm but the DeltaNet output's,
a plain-weight RMSNorm gated by silu(z).

Gated attention: q_proj yields, per head, [q | gate]; the attention output is multiplied by sigmoid(gate) before
o_proj; per-head q/k norms; partial rotary. DeltaNet: in_proj_qkv (q | k | v, causal depthwise conv + silu),
in_proj_z (the output gate), in_proj_b (beta = sigmoid(b)), in_proj_a (decay g = -exp(A_log) softplus(a + dt_bias)),
out_proj; the conv and the delta rule run on layers/delta_mixer.py's choice (Triton kernels on CUDA, else torch ops).
Heads are the TP shards: every DeltaNet tensor is cut by heads (q/k by key heads, v/z/a/b/A_log/dt_bias by value
heads, the conv's channels as q | k | v), out_proj by its input; the model code does not know it.

A multimodal `qwen3_5` checkpoint serves its language model: the vision tower's tensors are skipped."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from loraplex.worker.kv_cache import KVLayer
from loraplex.worker.layers.attention import BatchAttention, paged_attention
from loraplex.worker.layers.delta_mixer import select_delta_mixer
from loraplex.worker.layers.embedding import Embedding, LMHead
from loraplex.worker.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from loraplex.worker.layers.moe import SharedExpertMoeBlock
from loraplex.worker.layers.norm import GemmaRMSNorm
from loraplex.worker.layers.ops import current_ops
from loraplex.worker.layers.rotary import RotaryEmbedding
from loraplex.worker.model.config import LinearAttentionConfig, ModelConfig
from loraplex.worker.model.llama import LlamaMLP, layer_attention
from loraplex.worker.parallel import current_tp
from loraplex.worker.state_cache import HybridCache, LayerState, run_rounds
from torch import nn


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * w * silu(z) over each value head (w a plain weight, init 1), as the reference rounds it."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()  # (rows, dim)
        normed = (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class HeadShardedParam(nn.Module):
    """Holds parameters cut along dim 0 in runs (each run split evenly over the TP ranks, rank r keeping the r-th
    part of every run): A_log and dt_bias (one run of value heads), the conv weight (runs q | k | v)."""

    def __init__(self):
        super().__init__()
        tp = current_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.runs: dict[str, list[int]] = {}
        self.tails: dict[str, tuple[int, ...]] = {}

    def add(self, name: str, runs: list[int], *tail: int) -> None:
        for run in runs:
            if run % self.tp_size:
                raise ValueError(f"{name}: {run} rows are not divisible by tp {self.tp_size}")
        param = nn.Parameter(torch.empty(sum(runs) // self.tp_size, *tail), requires_grad=False)
        param.weight_loader = self.weight_loader
        self.register_parameter(name, param)
        self.runs[name], self.tails[name] = runs, tail

    def _name(self, param: nn.Parameter) -> str:
        return next(name for name, p in self.named_parameters(recurse=False) if p is param)

    def full_shape(self, param: nn.Parameter, shard_id: int | None = None) -> tuple[int, ...]:
        name = self._name(param)
        return (sum(self.runs[name]), *self.tails[name])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        name = self._name(param)
        if tuple(loaded.shape) != self.full_shape(param):
            raise ValueError(f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, "
                             f"expected {self.full_shape(param)}")  # fmt: skip
        parts = [run.narrow(0, self.tp_rank * (run.shape[0] // self.tp_size), run.shape[0] // self.tp_size)
                 for run in loaded.split(self.runs[name])]  # fmt: skip
        param.data.copy_(torch.cat(parts).view(param.shape))


class GatedDeltaNet(HeadShardedParam):
    def __init__(self, config: ModelConfig):
        super().__init__()
        la: LinearAttentionConfig = config.linear_attention
        hidden = config.hidden_size
        self.key_head_dim, self.value_head_dim = la.key_head_dim, la.value_head_dim
        ranks = self.tp_size
        self.qkv_sizes = [la.key_dim // ranks, la.key_dim // ranks, la.value_dim // ranks]  # this shard's
        self.make_projections(hidden, la)
        # checkpoint names: conv1d.weight (channels, 1, kernel), A_log, dt_bias (value_heads,)
        self.conv1d = HeadShardedParam()
        self.conv1d.add("weight", [la.key_dim, la.key_dim, la.value_dim], 1, la.conv_kernel_size)
        self.add("A_log", [la.num_value_heads])
        self.add("dt_bias", [la.num_value_heads])
        self.norm = GatedRMSNorm(la.value_head_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(la.value_dim, hidden)
        self.mixer = select_delta_mixer(current_ops())  # bound at construction: the worker's choice, made at start-up

    def make_projections(self, hidden: int, la: LinearAttentionConfig) -> None:
        self.in_proj_qkv = MergedColumnParallelLinear(hidden, [la.key_dim, la.key_dim, la.value_dim])
        self.in_proj_z = ColumnParallelLinear(hidden, la.value_dim)
        self.in_proj_b = ColumnParallelLinear(hidden, la.num_value_heads)
        self.in_proj_a = ColumnParallelLinear(hidden, la.num_value_heads)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q | k | v (tokens, conv channels of this shard), z (tokens, value_heads * dv), b, a (tokens, value_heads)"""
        return self.in_proj_qkv(hidden), self.in_proj_z(hidden), self.in_proj_b(hidden), self.in_proj_a(hidden)

    def warmup(self, conv_states: torch.Tensor, states: torch.Tensor) -> int:
        """Compile the mixer's kernels on this layer's states (slot 0 left zero); the launches made."""
        return self.mixer.warmup(conv_states, states, self.conv1d.weight[:, 0], self.qkv_sizes[0] // self.key_head_dim)

    def forward(self, hidden: torch.Tensor, state: LayerState) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        mixed, z, b, a = self.project(hidden)
        beta = b.sigmoid()  # (tokens, value_heads)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        weight = self.conv1d.weight[:, 0]  # (channels, kernel)
        # (tokens, channels); in rounds where the pass saves snapshots (worker/state_cache.py), else in one go
        conv_out = run_rounds(state.rounds, lambda batch: self.mixer.conv(mixed, state.conv, weight, batch),
                              state.conv, state.conv_snapshots)  # fmt: skip
        q, k, v = conv_out.split(self.qkv_sizes, dim=-1)
        q = q.view(num_tokens, -1, self.key_head_dim)  # (tokens, key_heads, dk)
        k = k.view(num_tokens, -1, self.key_head_dim)
        v = v.view(num_tokens, -1, self.value_head_dim)  # (tokens, value_heads, dv)
        out = run_rounds(state.rounds, lambda batch: self.mixer.rule(q, k, v, g, beta, state.recurrent, batch),
                         state.recurrent, state.recurrent_snapshots)  # (tokens, value_heads, dv) float32
        out = self.norm(out.to(hidden.dtype).view(-1, self.value_head_dim), z.reshape(-1, self.value_head_dim))
        return self.out_proj(out.view(num_tokens, -1))  # (tokens, hidden)


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer_id: int):
        super().__init__()
        self.head_dim = hd = config.head_dim
        q_size, kv_size = config.num_heads * hd, config.num_kv_heads * hd
        # q_proj's rows are per head [q | gate]: a column cut by heads keeps them together
        self.qkv_proj = MergedColumnParallelLinear(config.hidden_size, [2 * q_size, kv_size, kv_size],
                                                   bias=config.qkv_bias)  # fmt: skip
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=config.qkv_bias)
        self.q_norm = GemmaRMSNorm(hd, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(hd, config.rms_norm_eps)
        self.rotary = rotary
        self.layer = layer_attention(config, layer_id)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv: KVLayer,
                attention: BatchAttention) -> torch.Tensor:  # fmt: skip
        num_tokens = hidden.shape[0]
        q_gate, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes_per_rank, dim=-1)
        q, gate = q_gate.view(num_tokens, -1, 2 * self.head_dim).chunk(2, dim=-1)  # (tokens, heads, hd) each
        q = self.q_norm(q.reshape(num_tokens, -1, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, -1, self.head_dim))  # (tokens, kv_heads, hd)
        v = v.reshape(num_tokens, -1, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v, kv[0], kv[1], attention, self.layer, kv.scales)  # (tokens, heads, hd)
        out = out.reshape(num_tokens, -1) * torch.sigmoid(gate.reshape(num_tokens, -1))
        return self.o_proj(out)  # (tokens, hidden)


class Qwen3_5DecoderLayer(nn.Module):
    linear_attn_cls: type[nn.Module] = GatedDeltaNet

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer_id: int):
        super().__init__()
        self.is_linear = layer_id in config.linear_attention.layer_ids
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_linear:
            self.linear_attn = self.linear_attn_cls(config)
        else:
            self.self_attn = GatedAttention(config, rotary, layer_id)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.moe
        if moe is None or layer_id in moe.dense_layers:
            self.mlp = LlamaMLP(config)
        else:  # Qwen3.5-MoE, Qwen3-Next: routed experts and a shared one
            shared = LlamaMLP(dataclasses.replace(config, intermediate_size=moe.shared_intermediate_size))
            self.mlp = SharedExpertMoeBlock(config.hidden_size, moe.num_experts, moe.top_k, moe.intermediate_size,
                                            moe.renormalize, shared)  # fmt: skip

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                cache: HybridCache, cache_index: int, attention: BatchAttention,
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """As LlamaDecoderLayer: (this layer's MLP output, the residual stream before it)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.is_linear:
            hidden = self.linear_attn(hidden, cache.linear_state(cache_index))
        else:
            hidden = self.self_attn(positions, hidden, cache.layer(cache_index), attention)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3_5Model(nn.Module):
    layer_cls: type[nn.Module] = Qwen3_5DecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.head_dim, max_positions, config.rope)
        self.layers = nn.ModuleList(self.layer_cls(config, rotary, i) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # each layer's index in its own cache: the attention layers' KV, the linear ones' state slots
        linear = config.linear_attention.layer_ids
        attn = config.attention_layer_ids
        self.cache_index = [linear.index(i) if i in linear else attn.index(i) for i in range(config.num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: HybridCache,
                attention: BatchAttention) -> torch.Tensor:  # fmt: skip
        hidden, residual = self.embed_tokens(input_ids), None  # (tokens, hidden)
        for layer, cache_index in zip(self.layers, self.cache_index, strict=True):
            hidden, residual = layer(positions, hidden, residual, cache, cache_index, attention)
        return self.norm(hidden, residual)[0]


class Qwen3_5ForCausalLM(nn.Module):
    model_cls: type[nn.Module] = Qwen3_5Model
    checkpoint_prefixes = (
        ("model.language_model.", "model."),
        ("model.visual.", None),
        ("mtp.", None),  # the multi-token-prediction head (speculative decoding): not served
    )

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, max_positions)
        tied_to = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied_to)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: HybridCache,
                attention: BatchAttention) -> torch.Tensor:  # fmt: skip
        return self.model(input_ids, positions, cache, attention)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
