"""A mixture-of-experts MLP block: a router picks each token's top-k experts, each expert is a SiLU-gated MLP, and
the token's output is the routing-weighted sum of its experts' outputs.

The experts' weights are stacked: gate_up_proj (experts, 2 * intermediate_per_rank, hidden) and down_proj
(experts, hidden, intermediate_per_rank). Tensor parallelism splits every expert's intermediate dimension as the
dense MLP does (gate_up column-parallel, down row-parallel), so each rank computes every expert on its slice and the
block's one all-reduce sums the ranks' partial outputs after the weighted sum. With --enable-expert-parallel the
experts are sharded by expert instead (each rank holds E / tp of them, whole) and each row runs on the rank holding
its expert (worker/layers/expert_parallel.py); the block's all-reduce then sums the ranks' tokens.

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
from loraplex.kernels.moe_matmul import moe_matmul_triton
from loraplex.kernels.mxfp4_matmul import launch_mxfp4_matmul
from loraplex.worker.layers.activation import SiluAndMul
from loraplex.worker.layers.expert_parallel import ExpertDispatcher
from loraplex.worker.layers.expert_weights import (
    Mxfp4ExpertWeights,
    PlainExpertWeights,
    QuantizedExpertWeights,
    build_expert_weights,
)
from loraplex.worker.parallel import all_reduce, current_tp
from loraplex.worker.quant.layer import current_format
from torch import nn


@dataclass
class Routing:
    """One forward's rows: which token and expert each row is, and each expert's range of rows. Built with device ops
    alone (`on_device`: nothing is read back, so a CUDA graph captures it and the experts run as one grouped kernel),
    or with one copy to the host that the host path's loop over experts reads."""

    num_experts: int
    token_ids: torch.Tensor  # (rows,) int64: each row's token
    row_weights: torch.Tensor  # (rows,) float32: each row's routing weight
    row_experts: torch.Tensor  # (rows,) int64: each row's expert, ascending
    expert_indptr: torch.Tensor  # (experts + 1,) int32: expert e's rows are expert_indptr[e] ... [e + 1]
    expert_bounds: list[int] | None  # expert_indptr on the host; None on the device path
    host_token_ids: list[int] | None  # token_ids on the host; None on the device path
    extras: dict[str, Any] = field(default_factory=dict)  # what wrappers compute once per forward and share

    @property
    def on_device(self) -> bool:
        return self.expert_bounds is None

    @classmethod
    def build(cls, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, *,
              on_device: bool = False) -> Routing:  # fmt: skip
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.flatten()  # (tokens * top_k,) row t * top_k + j: token t's j-th choice
        row_experts, order = torch.sort(flat_ids, stable=True)  # by expert, tokens in order within one
        return cls.of_sorted(row_experts, order // top_k, topk_weights.flatten().float()[order], num_experts,
                             on_device=on_device)  # fmt: skip

    @classmethod
    def of_rows(cls, expert_ids: torch.Tensor, token_ids: torch.Tensor, row_weights: torch.Tensor,
                num_experts: int) -> tuple[Routing, torch.Tensor]:  # fmt: skip
        """Rows given one by one (expert parallelism's received rows), tokens in batch order within an expert:
        (their Routing, order) where routed row i is given row order[i]."""
        row_experts, order = torch.sort(expert_ids, stable=True)
        return cls.of_sorted(row_experts, token_ids[order], row_weights[order], num_experts), order

    @classmethod
    def of_sorted(cls, row_experts: torch.Tensor, token_ids: torch.Tensor, row_weights: torch.Tensor,
                  num_experts: int, *, on_device: bool = False) -> Routing:  # fmt: skip
        """Rows sorted by expert: row_experts (rows,) ascending; token_ids, row_weights (rows,)."""
        # each expert's first row, and the end: a search of the sorted ids (bincount would read its maximum back)
        experts = torch.arange(num_experts + 1, dtype=row_experts.dtype, device=row_experts.device)
        expert_indptr = torch.searchsorted(row_experts, experts).to(torch.int32)  # (experts + 1,)
        expert_bounds = host_token_ids = None
        if not on_device:
            host = torch.cat([expert_indptr.long(), token_ids]).tolist()  # one copy: the loop over experts needs it
            expert_bounds, host_token_ids = host[: num_experts + 1], host[num_experts + 1 :]
        return cls(
            num_experts=num_experts,
            token_ids=token_ids,
            row_weights=row_weights,
            row_experts=row_experts,
            expert_indptr=expert_indptr,
            expert_bounds=expert_bounds,
            host_token_ids=host_token_ids,
        )

    def expert_ids(self) -> torch.Tensor:
        """(experts,) int32 0 ... experts - 1 on the routing's device: the grouped kernel's segment ids."""
        return torch.arange(self.num_experts, dtype=torch.int32, device=self.expert_indptr.device)


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
    """Every expert's copy of one linear, stacked in one of expert_weights.py's forms (plain: weight (experts,
    out_per_rank, in_per_rank); MXFP4; a linear format's FP8 or packed integers). `tp_mode` and the size
    attributes follow worker/layers/linear.py's promise to wrappers, per expert; forward(rows, routing) applies each
    expert's weight to its rows. `partial`/`finish` as there: a row-parallel one leaves its sum to the block.
    Under expert parallelism it holds num_experts of the checkpoint's num_global_experts, from first_expert on, whole
    (tp_size 1 within an expert); its loaders take the checkpoint's tensors and expert ids as they are."""

    def __init__(self, num_experts: int, input_size: int, output_sizes: list[int], tp_mode: str, *,
                 bias: bool = False, interleaved: bool = False):  # fmt: skip
        """interleaved: a stacked checkpoint tensor's slices' rows alternate (row i of slice s is row i * slices + s),
        as gpt-oss stores gate_up."""
        super().__init__()
        self.interleaved = interleaved
        tp = current_tp()
        self.tp_mode = tp_mode
        self.num_global_experts = num_experts  # the checkpoint's
        if tp.expert_parallel and tp.world_size > 1:
            # sharded by expert (worker/layers/expert_parallel.py): experts first_expert ... + num_experts - 1, each
            # whole, so within an expert this rank is the only shard
            if num_experts % tp.world_size:
                raise ValueError(f"--enable-expert-parallel needs the experts ({num_experts}) divisible by tp "
                                 f"{tp.world_size}")  # fmt: skip
            self.num_experts = num_experts // tp.world_size
            self.first_expert = tp.rank * self.num_experts
            self.tp_rank, self.tp_size = 0, 1
        else:
            self.num_experts, self.first_expert = num_experts, 0
            self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        split_sizes = [input_size] if tp_mode == "row" else output_sizes
        if any(size % self.tp_size for size in split_sizes):
            raise ValueError(f"expert linear {input_size} -> {output_sizes} is not divisible by tp {self.tp_size}")
        self.input_size_per_rank = input_size // self.tp_size if tp_mode == "row" else input_size
        self.output_sizes_per_rank = [s // self.tp_size for s in output_sizes] if tp_mode == "column" else output_sizes
        self.output_offsets_per_rank = [0, *itertools.accumulate(self.output_sizes_per_rank)][:-1]
        self.storage = build_expert_weights(self, current_format())
        self.packed = isinstance(self.storage, Mxfp4ExpertWeights)  # stacked MXFP4 codes, stored (experts, out, ...)
        # on CUDA MXFP4 codes are decoded inside the matmul's tiles (kernels/mxfp4_matmul.py); chosen once, here
        self.mxfp4_triton = self.packed and torch.empty(0).device.type == "cuda"  # built under the target device
        self.bias = None
        if bias:
            bias_shape = (self.num_experts, sum(self.output_sizes_per_rank))
            self.bias = nn.Parameter(torch.empty(bias_shape), requires_grad=False)
            self.bias.weight_loader = self.bias_loader
        # a checkpoint's stacked tensor is (experts, in, out) (Llama 4's, gpt-oss's), not (experts, out, in): set by the
        # model (MXFP4 codes are stored (experts, out, ...) whatever it says)
        self.stacked_in_out = False
        # either layout, told by the shape (an (experts, out, in) tensor taken where out == in): Qwen3-VL-MoE's
        # published checkpoints are (experts, in, out), transformers 5 saves them (experts, out, in); set by the model
        self.either_layout = False

    @property
    def num_slices(self) -> int:
        return len(self.output_sizes)

    def checkpoint_shards(self) -> list[tuple[int, int]]:
        """The (expert, slice) pieces of a per-expert checkpoint this rank holds (checkpoint expert ids), each loaded
        on its own."""
        experts = range(self.first_expert, self.first_expert + self.num_experts)
        return [(e, s) for e in experts for s in range(self.num_slices)]

    def full_shape(self, param: nn.Parameter, shard_id: int | None = None) -> tuple[int, ...]:
        """The stacked checkpoint tensor weight_loader takes: every expert's slice `shard_id` (None: every slice)."""
        rows = sum(self.output_sizes) if shard_id is None else self.output_sizes[shard_id]
        if self.stacked_in_out and not self.packed:
            return self.num_global_experts, self._full_columns(param), rows
        return self.num_global_experts, rows, self._full_columns(param)

    def _full_columns(self, param: nn.Parameter) -> int:
        """Columns of the whole input in `param`'s units: inputs, MXFP4 code bytes (2 inputs) or scales (32)."""
        return param.shape[2] * self.tp_size if self.tp_mode == "row" else param.shape[2]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | int | None
    ) -> None:
        """shard_id (expert, slice): one expert's (out of the slice, in) tensor, as per-expert checkpoints hold them
        (another rank's expert is skipped); None: the stacked tensor of a checkpoint that saves experts fused; an int:
        every expert's slice, stacked."""
        if not isinstance(shard_id, tuple):
            if loaded.dim() == 4:  # MXFP4 codes as checkpoints store them: (experts, out, blocks, 16 bytes)
                loaded = loaded.flatten(2)
            expected = self.full_shape(param, shard_id)
            if self.either_layout and tuple(loaded.shape) == (expected[0], expected[2], expected[1]) != expected:
                loaded = loaded.transpose(1, 2)  # (experts, in, out) -> as expected
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
        local = expert - self.first_expert
        if not 0 <= local < self.num_experts:
            return  # expert parallelism: another rank holds it
        expected = (self.output_sizes[slice_id], self._full_columns(param))
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expert {expert} tensor has shape {tuple(loaded.shape)}, expected {expected}")
        if self.tp_mode == "column":
            num_rows = self.output_sizes_per_rank[slice_id]
            shard = loaded.narrow(0, self.tp_rank * num_rows, num_rows)
        else:
            num_cols = param.shape[2]  # this rank's inputs, in param's units
            shard = loaded.narrow(1, self.tp_rank * num_cols, num_cols)
        rows = param.data[local].narrow(0, self.output_offsets_per_rank[slice_id], shard.shape[0])
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
        expected = (self.num_global_experts, sum(self.output_sizes))
        if tuple(loaded.shape) != expected:
            raise ValueError(f"stacked experts bias has shape {tuple(loaded.shape)}, expected {expected}")
        loaded = self.checkpoint_order(loaded.narrow(0, self.first_expert, self.num_experts))
        if self.tp_mode == "column":
            starts = [0, *itertools.accumulate(self.output_sizes)][:-1]
            pieces = [loaded.narrow(1, start + self.tp_rank * size, size)
                      for start, size in zip(starts, self.output_sizes_per_rank, strict=True)]  # fmt: skip
            loaded = torch.cat(pieces, dim=1)
        param.data.copy_(loaded)

    def forward(self, rows: torch.Tensor, routing: Routing) -> torch.Tensor:
        return self.partial(rows, routing)

    def expert_weight(self, expert: int) -> torch.Tensor:
        """(out_per_rank, in_per_rank) of one expert in the activation dtype; quantized experts dequantize it here,
        one expert's tile at a time."""
        return self.storage.expert_weight(expert)

    @property
    def is_quantized(self) -> bool:
        return not isinstance(self.storage, PlainExpertWeights)

    @property
    def num_weights(self) -> int:
        """Weights this rank holds (every expert's out_per_rank x in_per_rank)."""
        return self.num_experts * sum(self.output_sizes_per_rank) * self.input_size_per_rank

    @property
    def resident_bytes(self) -> int:
        """Bytes of this rank's expert weights held on the device, in their stored form (biases not counted)."""
        return self.storage.resident_bytes

    def read_plain(self) -> None:
        """Read the experts plain: the checkpoint leaves them unquantized beside quantized linears."""
        if isinstance(self.storage, QuantizedExpertWeights):
            self.storage.drop_placeholders()
            self.storage = PlainExpertWeights(self)

    @property
    def device_refusal(self) -> str | None:
        """Why the grouped kernel (kernels/moe_matmul.py: plain or MXFP4 experts) cannot run this linear, or None."""
        if isinstance(self.storage, Mxfp4ExpertWeights):
            return None
        if not isinstance(self.storage, PlainExpertWeights):
            return f"its {type(self.storage).__name__} are not a format the grouped MoE kernel reads"
        if self.weight.dtype in (torch.float16, torch.bfloat16, torch.float32):
            return None
        dtype = str(self.weight.dtype).removeprefix("torch.")
        return f"its {dtype} weights are not a format the grouped MoE kernel reads"

    def partial(self, rows: torch.Tensor, routing: Routing) -> torch.Tensor:
        # a row-parallel linear's bias is added on one rank: the block sums the ranks' partial outputs
        with_bias = self.bias is not None and (self.tp_mode == "column" or self.tp_rank == 0)
        if routing.on_device:  # one launch, its grid from shapes alone
            weight, scales = (self.blocks, self.scales) if self.packed else (self.weight, None)
            bias = self.bias if with_bias else None
            return moe_matmul_triton(rows.contiguous(), weight, routing.expert_indptr, routing.expert_ids(), bias,
                                     scales)  # fmt: skip
        out = rows.new_empty(rows.shape[0], sum(self.output_sizes_per_rank))  # (rows, out_per_rank)
        bounds = routing.expert_bounds
        for expert in range(self.num_experts):
            start, end = bounds[expert], bounds[expert + 1]
            if end == start:
                continue
            if self.mxfp4_triton:  # the codes' shapes are this layer's own: no checks per launch
                launch_mxfp4_matmul(rows[start:end].contiguous(), self.blocks[expert], self.scales[expert],
                                    out[start:end])  # fmt: skip
            else:
                torch.matmul(rows[start:end], self.expert_weight(expert).T, out=out[start:end])
            if with_bias:
                out[start:end] += self.bias[expert]
        return out

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return y  # the block reduces once, after the weighted sum

    def extra_repr(self) -> str:
        experts = f"{self.first_expert}..{self.first_expert + self.num_experts - 1} of {self.num_global_experts}"
        return f"experts={experts}, in={self.input_size}, out={self.output_sizes}, tp={self.tp_size}"


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
        self.routes_on_device = False  # set once at start-up (use_device_routing)
        tp = current_tp()
        self.tp_size = tp.world_size
        # expert parallelism: the experts are this rank's share, and rows travel to the rank holding theirs
        self.dispatcher = (ExpertDispatcher(num_experts, tp.rank, tp.world_size)
                           if tp.expert_parallel and tp.world_size > 1 else None)  # fmt: skip
        self.gate = RouterLinear(hidden_size, num_experts, bias=router_bias)
        self.experts = experts or MoEExperts(num_experts, hidden_size, intermediate_size)

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (tokens, top_k) float32, expert ids (tokens, top_k)) of each token's experts."""
        return route(self.gate(hidden), self.top_k, self.renormalize)

    def forward(self, hidden: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        return all_reduce(self.routed(hidden, router_input), self.tp_size)

    def routed(self, hidden: torch.Tensor, router_input: torch.Tensor | None = None) -> torch.Tensor:
        """(tokens, hidden): each token's sum of its experts' weighted outputs, this rank's share of it (under TP
        each expert's partial output, under expert parallelism this rank's tokens; the caller all-reduces).
        `router_input`: what the router reads, where it is not the experts' input (Gemma 4); None: hidden."""
        router_input = hidden if router_input is None else router_input
        if self.dispatcher is not None:
            return self._routed_by_expert(hidden, router_input)
        weights, ids = self.route(router_input)  # (tokens, top_k) each
        routing = Routing.build(ids, weights, self.num_experts, on_device=self.routes_on_device)
        out_rows = self.expert_outputs(hidden[routing.token_ids], routing)  # (rows, hidden)
        return torch.zeros_like(hidden).index_add_(0, routing.token_ids, out_rows)  # (tokens, hidden)

    def expert_outputs(self, rows: torch.Tensor, routing: Routing) -> torch.Tensor:
        """(rows, hidden): each row's expert output, weighted by its routing weight."""
        out_rows = self.experts(rows, routing)
        return out_rows * routing.row_weights.to(out_rows.dtype)[:, None]

    def _routed_by_expert(self, hidden: torch.Tensor, router_input: torch.Tensor) -> torch.Tensor:
        """routed() under expert parallelism: this rank's tokens routed, their rows run where their experts are."""
        dispatcher = self.dispatcher
        start, end = dispatcher.token_range(hidden.shape[0])
        weights, ids = self.route(router_input[start:end])  # (tokens of this rank, top_k) each
        received = dispatcher.dispatch(hidden[start:end], weights, ids, start)
        routing, order = Routing.of_rows(received.expert_ids, received.token_ids, received.row_weights,
                                         dispatcher.num_local_experts)  # fmt: skip
        out_rows = torch.empty_like(received.rows)  # (received, hidden), in received order
        out_rows[order] = self.expert_outputs(received.rows[order], routing)
        out = torch.zeros_like(hidden)
        out[start:end] = dispatcher.combine(out_rows, received, end - start)
        return out


def device_routing_refusal(model: nn.Module) -> str | None:
    """Why `model`'s MoE blocks cannot route on the device (an expert format the grouped kernel does not read, or
    expert parallelism), or None."""
    for name, module in model.named_modules():
        if isinstance(module, ExpertsLinear) and module.device_refusal is not None:
            return f"{name}: {module.device_refusal}"
        if isinstance(module, SparseMoeBlock) and module.dispatcher is not None:
            return f"{name}: expert parallelism sizes its exchange of rows on the host"
    return None


def use_device_routing(model: nn.Module) -> int:
    """Every MoE block of `model` routes on the device from now on (chosen once, at start-up); how many blocks."""
    if (refusal := device_routing_refusal(model)) is not None:
        raise ValueError(f"MoE routing cannot run on the device: {refusal}")
    blocks = [module for module in model.modules() if isinstance(module, SparseMoeBlock)]
    for block in blocks:
        block.routes_on_device = True
    return len(blocks)


@torch.inference_mode()
def warm_up_device_routing(model: nn.Module) -> int:
    """Launch the grouped kernel once per variant it compiles (its row tile: 16, 32 or 64 rows, from the mean rows per
    expert) for each kind of experts linear in `model`, before any request meets them; the launches."""
    kinds: dict[tuple, ExpertsLinear] = {}
    for module in model.modules():
        if isinstance(module, ExpertsLinear):
            key = (module.num_experts, module.input_size_per_rank, tuple(module.output_sizes_per_rank), module.packed,
                   module.bias is not None)  # fmt: skip
            kinds.setdefault(key, module)
    for linear in kinds.values():
        device = linear.scales.device if linear.packed else linear.weight.device
        dtype = linear.storage.dtype if linear.packed else linear.weight.dtype
        for rows_per_expert in (1, 32, 33):  # segment_tiles.plan_tiles' three row tiles
            ids = torch.arange(linear.num_experts, device=device).repeat_interleave(rows_per_expert)[:, None]
            routing = Routing.build(ids, torch.ones(ids.shape, device=device), linear.num_experts, on_device=True)
            linear.partial(torch.zeros(ids.shape[0], linear.input_size_per_rank, dtype=dtype, device=device), routing)
    return 3 * len(kinds)


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

    def expert_outputs(self, rows: torch.Tensor, routing: Routing) -> torch.Tensor:
        # the weights rounded to the activations' dtype first, as the reference rounds them
        return self.experts(rows * routing.row_weights.to(rows.dtype)[:, None], routing)  # (rows, hidden)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_experts(hidden) + all_reduce(self.routed(hidden), self.tp_size)
