"""Qwen3-VL's vision tower: patches -> per merged 2x2 (spatial_merge_size**2) group of patches, the row that replaces
an image's placeholder token in the language model and its deepstack rows, which the first decoder layers add.

Per image of grid (t, h, w) patches, each row of pixel_values one patch (channels x temporal_patch_size x patch x
patch, in merge-block order as the image processor flattens it): a linear patch embedding with a bias (the
checkpoint's Conv3d, stride = kernel) plus a learned position embedding, the square grid of num_position_embeddings
resampled bilinearly (corners aligned) to the image's h x w; blocks of pre-LayerNorm attention (2-D rotary: half the
frequencies turned by the patch's row, half by its column) and a GELU (tanh) MLP, every block over a whole frame; the
patch merger (LayerNorm over each patch, the group concatenated, Linear-GELU-Linear) and, after each block of
deepstack_indexes, a deepstack merger (the same, its LayerNorm over the concatenated group). No windows: the patches
stay in image order and several images go through in one call, each frame attending within itself.

Sharded like Qwen2.5-VL's tower (qwen2_5_vl_vision.py, whose attention this reuses): heads and the MLP's width split
over the ranks (column then row parallel), each merger's hidden width too; the position table is replicated."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraplex.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from loraplex.worker.model.config import VisionConfig
from loraplex.worker.model.qwen2_5_vl_vision import PatchEmbed as Qwen2_5_VLPatchEmbed
from loraplex.worker.model.qwen2_5_vl_vision import VisionAttention, _runs
from torch import nn

NORM_EPS = 1e-6  # the tower's LayerNorms (fixed in transformers' code, not in the config)


class PatchEmbed(Qwen2_5_VLPatchEmbed):
    def __init__(self, config: VisionConfig):
        super().__init__(config)
        self.proj.bias = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return super().forward(pixels) + self.proj.bias  # (patches, hidden)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=NORM_EPS)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=NORM_EPS)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: list[torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, runs)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """The group of merge**2 patches -> one row of out_hidden. post_shuffle: the LayerNorm over the concatenated
    group (the deepstack mergers'), else over each patch before concatenating (the final merger's)."""

    def __init__(self, config: VisionConfig, post_shuffle: bool):
        super().__init__()
        self.group = config.hidden_size * config.spatial_merge_size**2
        self.post_shuffle = post_shuffle
        self.norm = nn.LayerNorm(self.group if post_shuffle else config.hidden_size, eps=NORM_EPS)
        self.linear_fc1 = ColumnParallelLinear(self.group, self.group, bias=True)
        self.linear_fc2 = RowParallelLinear(self.group, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.group)) if self.post_shuffle else self.norm(x).view(-1, self.group)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # (merged rows, out_hidden)


class Qwen3VLVisionTower(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Module()  # the checkpoint's nn.Embedding: read as a table, never by token ids
        self.pos_embed.weight = nn.Parameter(torch.empty(config.num_position_embeddings, config.hidden_size),
                                             requires_grad=False)  # fmt: skip
        self.side = int(config.num_position_embeddings**0.5)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, post_shuffle=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(config, post_shuffle=True)
                                                   for _ in config.deepstack_indexes)  # fmt: skip
        spatial = config.head_dim // 2  # half the frequencies for the row, half for the column
        self.register_buffer("inv_freq", 1.0 / config.rope_theta ** (
            torch.arange(0, spatial, 2, dtype=torch.float32) / spatial), persistent=False)  # fmt: skip

    def forward(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        """pixels (patches of every image, patch dim), grids: each image's (t, h, w) in patches -> (merged rows of
        every image in order, 1 + len(deepstack_indexes), out_hidden): the row that replaces its placeholder, then
        what deepstack adds to it after decoder layer 0, 1, ..."""
        device = pixels.device
        rows, cols = _patch_positions(grids, self.config.spatial_merge_size)  # (patches,) each, pixel_values' order
        x = self.patch_embed(pixels)  # (patches, hidden)
        x = x + self._position_embeddings(grids, rows, cols, device).to(x.dtype)
        positions = torch.stack((rows, cols), dim=1).to(device=device, dtype=torch.float32)  # (patches, 2)
        angles = (positions[..., None] * self.inv_freq).flatten(1)  # (patches, head_dim / 2): [row's | column's]
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # (patches, 1, head_dim)
        cos, sin = angles.cos(), angles.sin()
        runs = _runs([h * w for t, h, w in grids for _ in range(t)], device)  # each frame attends within itself
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, runs)
            if i in self.config.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[self.config.deepstack_indexes.index(i)](x))
        return torch.stack([self.merger(x), *deepstack], dim=1)

    def _position_embeddings(self, grids: list[list[int]], rows: torch.Tensor, cols: torch.Tensor,
                             device: torch.device) -> torch.Tensor:  # fmt: skip
        """(patches, hidden): the learned grid resampled to each image's h x w, bilinear with corners aligned (as
        transformers' F.interpolate-equivalent taps: 2 per axis, weights 1 - distance)."""
        heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grids])
        widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grids])
        row_taps, row_weights = _taps(rows, heights, self.side)
        col_taps, col_weights = _taps(cols, widths, self.side)
        index = (row_taps[:, :, None] * self.side + col_taps[:, None, :]).reshape(-1, 4).to(device)
        weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4).to(device)  # float32
        return (self.pos_embed.weight[index] * weights[:, :, None]).sum(1)


def _taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear taps (the two table rows around each point) and weights along one axis of `side` table rows, for
    points `index` of an axis `size` long (its ends on the table's ends)."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)  # (points, 2)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)  # (points, 2)
    return taps, weights


def _patch_positions(grids: list[list[int]], merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, column) in its frame, in pixel_values' order: merge blocks row-major, each block's patches
    row-major (the processor's flattening); every frame alike."""
    rows, cols = [], []
    for t, h, w in grids:
        row = torch.arange(h)[:, None].expand(h, w).reshape(h // merge, merge, w // merge, merge)
        col = torch.arange(w)[None, :].expand(h, w).reshape(h // merge, merge, w // merge, merge)
        rows.append(row.transpose(1, 2).flatten().repeat(t))
        cols.append(col.transpose(1, 2).flatten().repeat(t))
    return torch.cat(rows), torch.cat(cols)
