"""Qwen3-Next: Qwen3.5's hybrid decoder (qwen3_5.py) with MoE MLPs (routed experts and a gated shared expert; dense
where decoder_sparse_step / mlp_only_layers say) and the DeltaNet's input projections stored fused and grouped by key
head: in_proj_qkvz holds, for each key head, [q (dk) | k (dk) | v (m * dv) | z (m * dv)] (m = value heads per key
head), in_proj_ba [b (m) | a (m)]. Their weight loaders regroup the rows into q | k | v | z and b | a, each sharded by
heads like Qwen3.5's separate projections, so the forward pass is Qwen3.5's."""

from __future__ import annotations

import torch
from loraplex.worker.layers.linear import MergedColumnParallelLinear
from loraplex.worker.model.config import LinearAttentionConfig
from loraplex.worker.model.qwen3_5 import GatedDeltaNet, Qwen3_5DecoderLayer, Qwen3_5ForCausalLM, Qwen3_5Model
from torch import nn


def ungroup_rows(weight: torch.Tensor, num_groups: int, sizes: list[int]) -> torch.Tensor:
    """Rows stored per group as [part 0 | part 1 | ...] (each part sizes[i] // num_groups rows) -> every group's part
    0, then every group's part 1, ... (a tensor of the whole projection, or a LoRA B of it)."""
    per_group = [size // num_groups for size in sizes]
    groups = weight.reshape(num_groups, sum(per_group), *weight.shape[1:]).split(per_group, dim=1)
    return torch.cat([part.reshape(-1, *weight.shape[1:]) for part in groups])


class GroupedProjection(MergedColumnParallelLinear):
    """A fused projection whose checkpoint tensor is grouped by key head (see the module docstring); held as the
    slices `output_sizes`, each sharded on its own."""

    def __init__(self, input_size: int, output_sizes: list[int], num_groups: int):
        super().__init__(input_size, output_sizes)
        self.num_groups = num_groups

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None and loaded.shape[0] == sum(self.output_sizes):  # the checkpoint's grouped tensor
            loaded = ungroup_rows(loaded, self.num_groups, self.output_sizes)
        super().weight_loader(param, loaded, shard_id)


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    def make_projections(self, hidden: int, la: LinearAttentionConfig) -> None:
        self.in_proj_qkvz = GroupedProjection(hidden, [la.key_dim, la.key_dim, la.value_dim, la.value_dim],
                                              la.num_key_heads)  # fmt: skip
        self.in_proj_ba = GroupedProjection(hidden, [la.num_value_heads, la.num_value_heads], la.num_key_heads)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        qkvz = self.in_proj_qkvz(hidden)  # (tokens, q | k | v | z of this shard)
        z_size = self.in_proj_qkvz.output_sizes_per_rank[3]
        b, a = self.in_proj_ba(hidden).chunk(2, dim=-1)  # (tokens, value_heads of this shard) each
        return qkvz[:, :-z_size], qkvz[:, -z_size:], b, a


class Qwen3NextDecoderLayer(Qwen3_5DecoderLayer):
    linear_attn_cls = Qwen3NextGatedDeltaNet


class Qwen3NextModel(Qwen3_5Model):
    layer_cls = Qwen3NextDecoderLayer


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    model_cls = Qwen3NextModel
    checkpoint_prefixes = (("mtp.", None),)  # the multi-token-prediction head (speculative decoding): not served
