"""DeepSeek-V3 / V3.1 and Kimi K2 (model_type deepseek_v3): multi-head latent attention (MLA) and a MoE with shared
experts and a grouped sigmoid router; the first `first_k_dense_replace` layers keep a dense MLP.

Latent attention. Per token, kv_a_proj_with_mqa gives a latent c (kv_lora_rank, RMS-normed) and one rotary key k_pe
shared by every head; kv_b_proj expands c to each head's k_nope and v. The paged cache holds only [c | k_pe] per token
and layer (one "head" of kv_lora_rank + qk_rope_head_dim, keys and values in one tensor). Attention runs in one of two
forms, equal in exact arithmetic, chosen per request by its number of new tokens:

Prefills (several new tokens): the expanded form, the reference's own. The request's whole context, cached prefix
pages and the new tokens alike, is gathered from the cache as [c | k_pe] and expanded by kv_b_proj applied as a
linear to [k_nope | v] per head; q = [q_nope | q_pe] attends to k = [k_nope | k_pe] (k_pe broadcast over the heads)
and v, causally. With many new tokens it is the cheaper form: each head's scores and outputs run over qk_head_dim and
v_head_dim, not kv_lora_rank + rope, and the expansion is paid once per context token (once per chunk, in a chunked
prefill), shared by all of the new tokens.

Decodes (one new token): the absorbed form, which never expands the context:
    score(q, j) = q_nope · (W_uk c_j) + q_pe · k_pe_j = (W_ukᵀ q_nope) · c_j + q_pe · k_pe_j
    out         = Σ_j p_j W_uv c_j = W_uv (Σ_j p_j c_j)
so the query per head becomes [W_ukᵀ q_nope | q_pe] against the cached [c | k_pe] (multi-query attention with one KV
head), and the attention's output per head is the latent Σ p_j c_j (the leading kv_lora_rank of the values [c | k_pe],
the rope part dropped), mapped to v_head_dim by W_uv. For one query token this reads each cached latent once; the
expanded form would expand the whole context for it.

A batch holding both kinds is split (the attention metadata's decodes_and_prefills, worker/layers/attention.py), each
part run in its form and its outputs placed back in the batch's rows before o_proj. Both forms use the same softmax
scale, the qk head's with yarn's mscale² (MLAConfig.softmax_scale). kv_b_proj's `expand`, `absorb_query` and
`expand_values` do the products, so a LoRA wrapper on kv_b_proj adds its adapter's term to each
(worker/lora/latent.py); the other linears are plain ones to a LoRA wrapper.

Tensor parallelism: the heads are split over ranks (q_b_proj and kv_b_proj column-parallel by head, o_proj
row-parallel); q_a_proj and kv_a_proj_with_mqa are replicated, so every rank computes and caches the whole latent.
The rotary dims of the checkpoint come in (even, odd) pairs where rope_interleave says so (the reference's
apply_rotary_pos_emb_interleave): de-interleaved first, they rotate as rotate-half does, and q·k is unchanged by the
common permutation."""

from __future__ import annotations

import torch
from loraplex.worker.layers.attention import BatchPart, RowOwners, SplitBatchAttention
from loraplex.worker.layers.attention_spec import LayerAttention
from loraplex.worker.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from loraplex.worker.layers.moe import RouterLinear, route_grouped
from loraplex.worker.layers.norm import RMSNorm
from loraplex.worker.layers.rotary import RotaryEmbedding
from loraplex.worker.model.config import ModelConfig, ModelConfigError
from loraplex.worker.model.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from loraplex.worker.model.mixtral import MoEMLP
from torch import nn

LATENT_NORM_EPS = 1e-6  # the reference builds q_a_layernorm and kv_a_layernorm with the default eps, not the config's


class LatentKVProj(ColumnParallelLinear):
    """kv_b_proj: (heads * (qk_nope + v), kv_lora_rank), column-parallel by head (each head's rows [k_nope | v] lie
    together, so a rank's rows are whole heads). Applied as a linear to a prefill's gathered latents (`expand`), or
    in its two halves in the absorbed form (`absorb_query`, `expand_values`). `owners`: whose rows the input holds
    (worker/layers/attention.py's RowOwners), for a LoRA wrapper's per-request terms; the base ignores them."""

    packable = False  # its weight is read per head, never through a prepacked linear (worker/layers/packed.py)

    def __init__(self, kv_lora_rank: int, num_heads: int, qk_nope_head_dim: int, v_head_dim: int):
        super().__init__(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
        if self.quant is not None:  # the quantized matmuls keep no weight to split per head
            raise ModelConfigError(
                "quantized checkpoints of latent attention (DeepSeek-V3's FP8 ones) are not served: "
                "kv_b_proj's absorbed form reads its plain weight per head"
            )
        self.qk_nope_head_dim, self.v_head_dim = qk_nope_head_dim, v_head_dim

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk (heads, qk_nope, kv_lora_rank), W_uv (heads, v, kv_lora_rank)) of this rank's heads."""
        per_head = self.weight.view(-1, self.qk_nope_head_dim + self.v_head_dim, self.input_size)
        return per_head[:, : self.qk_nope_head_dim], per_head[:, self.qk_nope_head_dim :]

    def expand(self, latents: torch.Tensor, owners: RowOwners) -> torch.Tensor:
        """latents (rows, kv_lora_rank) -> [k_nope | v] (rows, heads, qk_nope + v) of this rank's heads."""
        out = self.forward(latents)  # (rows, heads * (qk_nope + v))
        return out.view(latents.shape[0], -1, self.qk_nope_head_dim + self.v_head_dim)

    def absorb_query(self, q_nope: torch.Tensor, owners: RowOwners) -> torch.Tensor:
        """q_nope (rows, heads, qk_nope) -> W_ukᵀ q_nope (rows, heads, kv_lora_rank)."""
        w_uk, _ = self.head_weights()
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def expand_values(self, latent_out: torch.Tensor, owners: RowOwners) -> torch.Tensor:
        """latent_out (rows, heads, kv_lora_rank) -> W_uv latent_out (rows, heads, v)."""
        _, w_uv = self.head_weights()
        return torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


class DeepseekV3Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, layer: LayerAttention):
        super().__init__()
        mla = config.mla
        self.mla = mla
        num_heads, hidden = config.num_heads, config.hidden_size
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, num_heads * mla.qk_head_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, mla.q_lora_rank, bias=config.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, num_heads * mla.qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, mla.cache_dim, bias=config.qkv_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentKVProj(mla.kv_lora_rank, num_heads, mla.qk_nope_head_dim, mla.v_head_dim)
        self.o_proj = RowParallelLinear(num_heads * mla.v_head_dim, hidden, bias=config.o_bias)
        self.rotary = rotary
        self.layer = LayerAttention(scale=mla.softmax_scale)  # not `layer`'s head_dim ** -0.5: the qk head's, yarn's

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        attention: SplitBatchAttention,
    ) -> torch.Tensor:
        mla, num_tokens = self.mla, hidden.shape[0]
        if mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))  # (tokens, heads * qk_head_dim) of this rank
        q = q.view(num_tokens, -1, mla.qk_head_dim)  # (tokens, heads, qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())  # (tokens, kv_lora_rank)
        k_pe = k_pe.unsqueeze(1)  # (tokens, 1, rope)
        if mla.rope_interleave:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = self.rotary(positions, q_pe.contiguous(), k_pe.contiguous())
        cache = kv[0]  # (slots, 1, cache_dim): [c | k_pe] per token, keys and values both
        cache.index_copy_(0, attention.write_slots, torch.cat((latent.unsqueeze(1), k_pe), dim=-1))
        out = q.new_empty(num_tokens, q.shape[1], mla.v_head_dim)  # (tokens, heads, v)
        decodes, prefills = attention.decodes_and_prefills()
        if decodes is not None:
            decodes.place(out, self._absorbed(decodes.take(q_nope), decodes.take(q_pe), cache, decodes))
        if prefills is not None:
            prefills.place(out, self._expanded(prefills.take(q_nope), prefills.take(q_pe), cache, prefills))
        return self.o_proj(out.view(num_tokens, -1))  # (tokens, hidden)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, part: BatchPart) -> torch.Tensor:
        """(rows, heads, qk_nope), (rows, heads, rope) -> (rows, heads, v): [W_ukᵀ q_nope | q_pe] against the cached
        [c | k_pe] as one KV head, the latent output mapped by W_uv."""
        owners = part.token_owners
        query = torch.cat((self.kv_b_proj.absorb_query(q_nope, owners), q_pe), dim=-1)  # (rows, heads, cache_dim)
        out = part.attend(query, cache, cache, self.layer)  # (rows, heads, cache_dim)
        return self.kv_b_proj.expand_values(out[..., : self.mla.kv_lora_rank], owners)  # (rows, heads, v)

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, part: BatchPart) -> torch.Tensor:
        """(rows, heads, qk_nope), (rows, heads, rope) -> (rows, heads, v): the context's latents expanded to every
        head's k_nope and v, then [q_nope | q_pe] against [k_nope | k_pe]."""
        mla = self.mla
        context = part.gather_context(cache).squeeze(1)  # (context, cache_dim)
        latents, k_pe = context.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        expanded = self.kv_b_proj.expand(latents, part.context_owners)  # (context, heads, qk_nope + v)
        k_nope, values = expanded.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        keys = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, k_nope.shape[1], -1)), dim=-1)  # (context, heads, qk)
        query = torch.cat((q_nope, q_pe), dim=-1)  # (rows, heads, qk)
        return part.attend_context(query, keys, values, self.layer)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(..., rope) pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): the rotate-half layout."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class DeepseekV3Router(RouterLinear):
    """RouterLinear in float32, as the reference computes the scores, and the correction bias its choice adds (whole
    on every rank too)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__(hidden_size, num_experts)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden.float(), self.weight.float())  # (tokens, experts)


class DeepseekV3MoE(MoEMLP):
    """The routed experts (the config's MoE block, routed as DeepSeek routes) plus the shared experts' one dense MLP."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        moe = self.moe = config.moe
        self.gate = DeepseekV3Router(config.hidden_size, moe.num_experts)
        shared_size = moe.shared_intermediate_size
        self.shared_experts = LlamaMLP(config, intermediate_size=shared_size) if shared_size else None

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        moe = self.moe
        return route_grouped(self.gate(hidden), self.gate.e_score_correction_bias, moe.top_k, moe.num_groups,
                             moe.topk_group, moe.renormalize, moe.routed_scaling_factor)  # fmt: skip

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden)  # (tokens, hidden)
        return out if self.shared_experts is None else out + self.shared_experts(hidden)


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    attention_cls = DeepseekV3Attention
    mlp_cls = DeepseekV3MoE


class DeepseekV3Model(LlamaModel):
    layer_cls = DeepseekV3DecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__(config, max_positions)
        for layer_id in config.moe.dense_layers:  # the first first_k_dense_replace layers
            self.layers[layer_id].mlp = LlamaMLP(config)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    model_cls = DeepseekV3Model
