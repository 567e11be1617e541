"""A mixture-of-experts MLP block: a router picks each token's top-k experts, each expert is a SiLU-gated MLP, and
the token's output is the routing-weighted sum of its experts' outputs.

The experts' weights are stacked: gate_up_proj (experts, 2 * intermediate_per_rank, hidden) and down_proj
(experts, hidden, intermediate_per_rank). Tensor parallelism splits every expert's intermediate dimension as the
dense MLP does (gate_up column-parallel, down row-parallel), so each rank computes every expert on its slice and the
block's one all-reduce sums the ranks' partial outputs after the weighted sum.

gpt-oss's experts add a bias to every expert linear (a row-parallel one's on rank 0 alone, so the block's sum adds it
once) and route with a biased router, softmax over the top-k logits alone; its checkpoints stack each linear as
(experts, in, out) with gate and up interleaved (gate_up's rows g0 u0 g1 u1 ...), which the loader turns into our
(experts, out, in) [gate | up] layout (`stacked_in_out`, `interleaved`).

Rows: each (token, chosen expert) pair is one row; the rows are sorted by expert, tokens in batch order within an
expert, so an expert's rows are one contiguous range (one matmul each), and the rows of one expert that come from one
request stay consecutive (a LoRA wrapper finds its segments there: see worker/lora/experts.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from loraplex.worker.layers.activation import SiluAndMul
from loraplex.worker.parallel import all_reduce, current_tp
from loraplex.worker.quant import mxfp4
from loraplex.worker.quant.layer import current_format
from torch import nn


@dataclass
class Routing:
    """One forward's rows: which token and expert each row is, and each expert's range of rows."""

    num_experts: int
    token_ids: torch.Tensor  # (rows,) int64: each row's token
    row_weights: torch.Tensor  # (rows,) float32: each row's routing weight
    expert_bounds: list[int]  # (experts + 1,) on the host: expert e's rows are expert_bounds[e] ... [e + 1]
    host_token_ids: list[int]  # token_ids on the host
    extras: dict[str, Any] = field(default_factory=dict)  # what wrappers compute once per forward and share

    @classmethod
    def build(cls, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> Routing:
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.flatten()  # (tokens * top_k,) row t * top_k + j: token t's j-th choice
        order = torch.sort(flat_ids, stable=True).indices  # by expert, tokens in order within one
        counts = torch.bincount(flat_ids, minlength=num_experts)
        token_ids = order // top_k
        host = torch.cat([counts, token_ids]).tolist()  # one copy to the host: the loop over experts needs it
        return cls(
            num_experts=num_experts,
            token_ids=token_ids,
            row_weights=topk_weights.flatten().float()[order],
            expert_bounds=[0, *itertools.accumulate(host[:num_experts])],
            host_token_ids=host[num_experts:],
        )


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (tokens, top_k) float32, expert ids (tokens, top_k)): softmax in float32, then top-k, as HF does."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # (tokens, experts)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's router: the top-k logits, then a softmax over those alone. (weights float32, expert ids)"""
    logits, ids = torch.topk(router_logits.float(), top_k, dim=-1)  # (tokens, top_k)
    return torch.softmax(logits, dim=-1), ids


def route_sigmoid(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's router, as HF's Llama4Router: the top-k logits, each through a sigmoid (the others weigh 0).
    (weights (tokens, top_k) float32, expert ids (tokens, top_k))"""
    logits, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.sigmoid(logits.float()), ids


def route_grouped(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_group: int,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router, as HF's DeepseekV3TopkRouter: sigmoid scores; the choice reads them plus the correction
    bias, within the `topk_group` groups whose two best experts score highest; the weights are the plain scores
    (renormalised when asked), times `scaling_factor`. (weights (tokens, top_k) float32, expert ids)"""
    scores = router_logits.float().sigmoid()  # (tokens, experts)
    for_choice = scores + correction_bias.float()
    num_tokens, num_experts = scores.shape
    grouped = for_choice.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)  # (tokens, groups)
    group_ids = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1).bool()  # (tokens, groups)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    ids = torch.topk(for_choice.masked_fill(~expert_mask, float("-inf")), k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids


class ExpertsLinear(nn.Module):
    """Every expert's copy of one linear, stacked: weight (experts, out_per_rank, in_per_rank). `tp_mode` and the size
    attributes follow worker/layers/linear.py's promise to wrappers, per expert; forward(rows, routing) applies each
    expert's weight to its rows. `partial`/`finish` as there: a row-parallel one leaves its sum to the block."""

    def __init__(self, num_experts: int, input_size: int, output_sizes: list[int], tp_mode: str, *,
                 bias: bool = False, interleaved: bool = False):  # fmt: skip
        """interleaved: a stacked checkpoint tensor's slices' rows alternate (row i of slice s is row i * slices + s),
        as gpt-oss stores gate_up."""
        super().__init__()
        self.interleaved = interleaved
        tp = current_tp()
        self.tp_rank, self.tp_size, self.tp_mode = tp.rank, tp.world_size, tp_mode
        self.num_experts = num_experts
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        split_sizes = [input_size] if tp_mode == "row" else output_sizes
        if any(size % self.tp_size for size in split_sizes):
            raise ValueError(f"expert linear {input_size} -> {output_sizes} is not divisible by tp {self.tp_size}")
        self.input_size_per_rank = input_size // self.tp_size if tp_mode == "row" else input_size
        self.output_sizes_per_rank = [s // self.tp_size for s in output_sizes] if tp_mode == "column" else output_sizes
        self.output_offsets_per_rank = [0, *itertools.accumulate(self.output_sizes_per_rank)][:-1]
        num_rows = sum(self.output_sizes_per_rank)
        fmt = current_format()
        self.packed = fmt is not None and fmt.experts_only  # MXFP4 (worker/quant/mxfp4.py): bytes kept resident
        if self.packed:
            if self.input_size_per_rank % mxfp4.BLOCK_SIZE:
                raise ValueError(f"mxfp4 experts' {self.input_size_per_rank} inputs per rank split a block of "
                                 f"{mxfp4.BLOCK_SIZE}")
            self.dtype = torch.get_default_dtype()  # of the dequantized tiles
            num_blocks = self.input_size_per_rank // mxfp4.BLOCK_SIZE
            self.blocks = self._packed_param((num_experts, num_rows, num_blocks * mxfp4.BLOCK_SIZE // 2),
                                             mxfp4.random_blocks)  # fmt: skip
            self.scales = self._packed_param((num_experts, num_rows, num_blocks), mxfp4.random_scales)
        else:
            weight = torch.empty(num_experts, num_rows, self.input_size_per_rank)
            self.weight = nn.Parameter(weight, requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(num_experts, sum(self.output_sizes_per_rank)), requires_grad=False)
            self.bias.weight_loader = self.bias_loader
        # a checkpoint's stacked tensor is (experts, in, out) (Llama 4's, gpt-oss's), not (experts, out, in): set by the
        # model (MXFP4 codes are stored (experts, out, ...) whatever it says)
        self.stacked_in_out = False

    @property
    def num_slices(self) -> int:
        return len(self.output_sizes)

    def checkpoint_shards(self) -> list[tuple[int, int]]:
        """The (expert, slice) pieces a per-expert checkpoint holds, each loaded on its own."""
        return [(e, s) for e in range(self.num_experts) for s in range(self.num_slices)]

    def _packed_param(self, shape: tuple[int, ...], draw) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
        param.weight_loader = self.weight_loader
        param.random_checkpoint = draw  # --load-format dummy draws the format's bytes (worker/dummy_weights.py)
        return param

    def full_shape(self, param: nn.Parameter, shard_id: int | None = None) -> tuple[int, ...]:
        """The stacked checkpoint tensor weight_loader takes: every expert's slice `shard_id` (None: every slice)."""
        rows = sum(self.output_sizes) if shard_id is None else self.output_sizes[shard_id]
        if self.stacked_in_out and not self.packed:
            return self.num_experts, self._full_columns(param), rows
        return self.num_experts, rows, self._full_columns(param)

    def _full_columns(self, param: nn.Parameter) -> int:
        """Columns of the whole input in `param`'s units: inputs, MXFP4 code bytes (2 inputs) or scales (32)."""
        return param.shape[2] * self.tp_size if self.tp_mode == "row" else param.shape[2]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | int | None
    ) -> None:
        """shard_id (expert, slice): one expert's (out of the slice, in) tensor, as per-expert checkpoints hold them;
        None: the stacked tensor of a checkpoint that saves experts fused; an int: every expert's slice, stacked."""
        if not isinstance(shard_id, tuple):
            if loaded.dim() == 4:  # MXFP4 codes as checkpoints store them: (experts, out, blocks, 16 bytes)
                loaded = loaded.flatten(2)
            expected = self.full_shape(param, shard_id)
            if tuple(loaded.shape) != expected:
                raise ValueError(f"stacked experts tensor has shape {tuple(loaded.shape)}, expected {expected}")
            if self.stacked_in_out and not self.packed:
                loaded = loaded.transpose(1, 2)  # (experts, out, in), as the pieces below are cut
            if shard_id is None:
                loaded = self.checkpoint_order(loaded)
            starts = [0, *itertools.accumulate(self.output_sizes)]
            for expert, slice_id in self.checkpoint_shards():
                if shard_id is None:
                    piece = loaded[expert].narrow(0, starts[slice_id], self.output_sizes[slice_id])
                elif slice_id == shard_id:
                    piece = loaded[expert]
                else:
                    continue
                self.weight_loader(param, piece, (expert, slice_id))
            return
        expert, slice_id = shard_id
        expected = (self.output_sizes[slice_id], self._full_columns(param))
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expert {expert} tensor has shape {tuple(loaded.shape)}, expected {expected}")
        if self.tp_mode == "column":
            num_rows = self.output_sizes_per_rank[slice_id]
            shard = loaded.narrow(0, self.tp_rank * num_rows, num_rows)
        else:
            num_cols = param.shape[2]  # this rank's inputs, in param's units
            shard = loaded.narrow(1, self.tp_rank * num_cols, num_cols)
        rows = param.data[expert].narrow(0, self.output_offsets_per_rank[slice_id], shard.shape[0])
        rows.copy_(shard)

    def checkpoint_order(self, stacked: torch.Tensor) -> torch.Tensor:
        """(experts, out, ...) as the checkpoint orders the rows -> slice after slice ([gate | up])."""
        if not self.interleaved:
            return stacked
        num_experts, num_rows = stacked.shape[:2]
        per_slice = stacked.view(num_experts, num_rows // self.num_slices, self.num_slices, *stacked.shape[2:])
        return per_slice.transpose(1, 2).reshape(stacked.shape)

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: None) -> None:
        """The stacked (experts, out) bias; a column-parallel linear keeps its rows of each slice."""
        expected = (self.num_experts, sum(self.output_sizes))
        if tuple(loaded.shape) != expected:
            raise ValueError(f"stacked experts bias has shape {tuple(loaded.shape)}, expected {expected}")
        loaded = self.checkpoint_order(loaded)
        if self.tp_mode == "column":
            starts = [0, *itertools.accumulate(self.output_sizes)][:-1]
            pieces = [loaded.narrow(1, start + self.tp_rank * size, size)
                      for start, size in zip(starts, self.output_sizes_per_rank, strict=True)]  # fmt: skip
            loaded = torch.cat(pieces, dim=1)
        param.data.copy_(loaded)

    def forward(self, rows: torch.Tensor, routing: Routing) -> torch.Tensor:
        return self.partial(rows, routing)

    def expert_weight(self, expert: int) -> torch.Tensor:
        """(out_per_rank, in_per_rank) of one expert; MXFP4 experts dequantize it here, one expert's tile at a time."""
        if self.packed:
            return mxfp4.dequantize(self.blocks[expert], self.scales[expert], self.dtype)
        return self.weight[expert]

    @property
    def resident_bytes(self) -> int:
        """Bytes of this rank's expert weights held on the device (MXFP4: codes and scales; biases not counted)."""
        params = (self.blocks, self.scales) if self.packed else (self.weight,)
        return sum(p.numel() * p.element_size() for p in params)

    def partial(self, rows: torch.Tensor, routing: Routing) -> torch.Tensor:
        out = rows.new_empty(rows.shape[0], sum(self.output_sizes_per_rank))  # (rows, out_per_rank)
        bounds = routing.expert_bounds
        # a row-parallel linear's bias is added on one rank: the block sums the ranks' partial outputs
        with_bias = self.bias is not None and (self.tp_mode == "column" or self.tp_rank == 0)
        for expert in range(self.num_experts):
            start, end = bounds[expert], bounds[expert + 1]
            if end > start:
                torch.matmul(rows[start:end], self.expert_weight(expert).T, out=out[start:end])
                if with_bias:
                    out[start:end] += self.bias[expert]
        return out

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return y  # the block reduces once, after the weighted sum

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, in={self.input_size}, out={self.output_sizes}, tp={self.tp_size}"


class MoEExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act_fn: nn.Module | None = None,
                 **linear_kwargs: bool):  # fmt: skip
        super().__init__()
        size = intermediate_size
        self.gate_up_proj = ExpertsLinear(num_experts, hidden_size, [size, size], "column", **linear_kwargs)
        self.down_proj = ExpertsLinear(num_experts, size, [hidden_size], "row", **linear_kwargs)
        self.act_fn = act_fn or SiluAndMul()

    def forward(self, rows: torch.Tensor, routing: Routing) -> torch.Tensor:
        gate_up = self.gate_up_proj(rows, routing)  # (rows, 2 * intermediate_per_rank): [gate | up]
        return self.down_proj(self.act_fn(gate_up), routing)  # (rows, hidden): this rank's share


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated) and experts; forward(hidden) -> (tokens, hidden), all-reduced."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 experts: MoEExperts | None = None, router_bias: bool = False):  # fmt: skip
        """experts: a family's own (gpt-oss: biased, clamped SwiGLU); None: SiLU-gated experts without biases."""
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp_size = current_tp().world_size
        self.gate = RouterLinear(hidden_size, num_experts, bias=router_bias)
        self.experts = experts or MoEExperts(num_experts, hidden_size, intermediate_size)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (tokens, top_k) float32, expert ids (tokens, top_k)) of each token's experts."""
        return route(self.gate(hidden), self.top_k, self.renormalize)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.run_experts(hidden, *self.route(hidden))

    def run_experts(self, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routing-weighted sum of each token's experts (weights, ids (tokens, top_k)), all-reduced."""
        routing = Routing.build(ids, weights, self.num_experts)
        rows = hidden[routing.token_ids]  # (rows, hidden)
        out_rows = self.experts(rows, routing)  # (rows, hidden)
        out_rows = out_rows * routing.row_weights.to(out_rows.dtype)[:, None]
        out = torch.zeros_like(hidden).index_add_(0, routing.token_ids, out_rows)  # (tokens, hidden)
        return all_reduce(out, self.tp_size)


class RouterLinear(nn.Module):
    """The router's (experts, hidden) weight (and bias: gpt-oss), whole on every rank: logits = hidden · Wᵀ + b."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight, self.bias)  # (tokens, experts)


class SharedExpertMoeBlock(SparseMoeBlock):
    """Qwen3-Next / Qwen3.5-MoE: the routed experts plus a shared expert (a dense SiLU-gated MLP, sharded as one)
    whose output is scaled per token by sigmoid(shared_expert_gate(hidden)), a replicated one-output router."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 shared_expert: nn.Module):  # fmt: skip
        super().__init__(hidden_size, num_experts, top_k, intermediate_size, renormalize)
        self.shared_expert = shared_expert
        self.shared_expert_gate = RouterLinear(hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(hidden) * torch.sigmoid(self.shared_expert_gate(hidden))  # (tokens, hidden)
        return super().forward(hidden) + shared


class InputScaledMoeBlock(SparseMoeBlock):
    """Llama 4: each token's chosen experts (route_sigmoid) take its hidden state scaled by their routing weight, and
    their outputs are summed unweighted (the weight sits before the SiLU, so this is not the weighted sum of
    SparseMoeBlock); a shared expert (a dense SiLU-gated MLP, sharded as one) adds its output unscaled."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 shared_experts: nn.Module):  # fmt: skip
        super().__init__(hidden_size, num_experts, top_k, intermediate_size, renormalize=False)
        self.shared_experts = shared_experts

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route_sigmoid(self.gate(hidden), self.top_k)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(hidden)  # (tokens, top_k) each
        routing = Routing.build(ids, weights, self.num_experts)
        # (rows, hidden); the weights rounded to the activations' dtype first, as the reference rounds them
        rows = hidden[routing.token_ids] * routing.row_weights.to(hidden.dtype)[:, None]
        out_rows = self.experts(rows, routing)  # (rows, hidden)
        routed = torch.zeros_like(hidden).index_add_(0, routing.token_ids, out_rows)  # (tokens, hidden)
        return self.shared_experts(hidden) + all_reduce(routed, self.tp_size)
