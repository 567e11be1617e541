"""Qwen2.5-VL's vision tower: patches -> one embedding per merged 2x2 (spatial_merge_size**2) group of patches, the
rows that replace an image's placeholder tokens in the language model.

Per image of grid (t, h, w) patches, each row of pixel_values one patch (channels x temporal_patch_size x patch x
patch, as the image processor flattens it, already in merge-block order): a linear patch embedding (the checkpoint's
Conv3d, whose stride is its kernel); blocks of pre-norm attention and gated MLP with a 2-D rotary (half the
frequencies turned by the patch's row, half by its column); the patch merger (RMSNorm, the group's patches
concatenated, Linear-GELU-Linear). Windowed blocks attend within windows of window_size pixels, the blocks in
fullatt_block_indexes over the whole image; the patches are reordered window by window (in merge groups) before the
blocks so every window is one contiguous run, and the merged rows put back in image order at the end. Several images
go through in one call, each its own runs: no attention crosses an image (runs of one length attend as one batch).

Sharded like the language model: attention heads and the MLP's width split over the ranks (column then row
parallel), the merger's hidden width too."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraplex.worker.layers.activation import SiluAndMul
from loraplex.worker.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from loraplex.worker.layers.norm import RMSNorm
from loraplex.worker.model.config import VisionConfig
from torch import nn

NORM_EPS = 1e-6  # the tower's RMSNorms (Qwen2_5_VLRMSNorm's default, not in the config)


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        c = config
        # the checkpoint's Conv3d weight (hidden, channels, temporal, patch, patch); kernel = stride: one matmul
        self.proj = nn.Module()
        shape = (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj.weight = nn.Parameter(torch.empty(shape), requires_grad=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return pixels.to(weight.dtype) @ weight.view(weight.shape[0], -1).t()  # (patches, hidden)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        dim = config.hidden_size
        self.head_dim = config.head_dim
        self.qkv = MergedColumnParallelLinear(dim, [dim, dim, dim], bias=True)  # stored fused: q | k | v
        self.proj = RowParallelLinear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: list[torch.Tensor]) -> torch.Tensor:
        num = x.shape[0]
        q, k, v = (t.view(num, -1, self.head_dim) for t in self.qkv(x).split(self.qkv.output_sizes_per_rank, -1))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)  # (patches, heads, head_dim)
        out = torch.empty_like(q)
        for index in runs:  # (runs, length): the patches of runs of one length, each attending within itself
            q_runs, k_runs, v_runs = (t[index].transpose(1, 2) for t in (q, k, v))  # (runs, heads, length, head_dim)
            out[index] = F.scaled_dot_product_attention(q_runs, k_runs, v_runs).transpose(1, 2)
        return self.proj(out.reshape(num, -1))  # (patches, hidden)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # in float32 as the reference, then back
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat((-second, first), dim=-1) * sin).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=True)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=True)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, NORM_EPS)
        self.norm2 = RMSNorm(config.hidden_size, NORM_EPS)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: list[torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, runs)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.group = config.hidden_size * config.spatial_merge_size**2
        self.ln_q = RMSNorm(config.hidden_size, NORM_EPS)
        # the checkpoint's nn.Sequential(Linear, GELU, Linear): mlp.0 and mlp.2
        self.mlp = nn.ModuleList([ColumnParallelLinear(self.group, self.group, bias=True), nn.GELU(),
                                  RowParallelLinear(self.group, config.out_hidden_size, bias=True)])  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).view(-1, self.group)  # (merged rows, hidden * merge**2)
        return self.mlp[2](self.mlp[1](self.mlp[0](x)))  # (merged rows, out_hidden)


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        spatial = config.head_dim // 2  # half the frequencies for the row, half for the column
        self.register_buffer("inv_freq", 1.0 / config.rope_theta ** (
            torch.arange(0, spatial, 2, dtype=torch.float32) / spatial), persistent=False)  # fmt: skip

    def forward(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        """pixels (patches of every image, patch dim), grids: each image's (t, h, w) in patches -> (merged rows of
        every image in order, out_hidden)."""
        c = self.config
        unit = c.spatial_merge_size**2
        order, windows, images, positions = _layout(grids, c)
        device = pixels.device
        order = torch.tensor(order, device=device)
        x = self.patch_embed(pixels)  # (patches, hidden)
        x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)  # window by window
        angles = torch.tensor(positions, device=device, dtype=torch.float32)[..., None] * self.inv_freq
        angles = angles.flatten(1)  # (patches, head_dim / 2): [row's | column's]
        angles = angles.view(-1, unit, angles.shape[-1])[order].flatten(0, 1)
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # (patches, 1, head_dim)
        cos, sin = angles.cos(), angles.sin()
        window_runs, image_runs = _runs(windows, device), _runs(images, device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, image_runs if i in c.fullatt_block_indexes else window_runs)
        merged = self.merger(x)  # (merged rows, out_hidden), window order
        return merged[torch.argsort(order)]  # image order


def _layout(grids: list[list[int]], c: VisionConfig) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """(the merge groups in window order, each window's patches, each image's patches, each patch's (row, column) in
    pixel_values' order), as transformers' get_vision_window_index / get_vision_position_ids lay them out."""
    merge = c.spatial_merge_size
    per_window = c.window_size // merge // c.patch_size  # merged patches along a window's side
    order: list[int] = []
    windows: list[int] = []
    images: list[int] = []
    positions: list[list[int]] = []
    first = 0  # this image's first merge group
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        for _ in range(t):
            for wy in range(0, gh, per_window):
                for wx in range(0, gw, per_window):
                    rows, cols = range(wy, min(wy + per_window, gh)), range(wx, min(wx + per_window, gw))
                    order.extend(first + y * gw + x for y in rows for x in cols)
                    windows.append(len(rows) * len(cols) * merge * merge)
            first += gh * gw
            # each merge block's patches row-major, the blocks row-major (the processor's flattening)
            positions.extend([by * merge + dy, bx * merge + dx]
                             for by in range(gh) for bx in range(gw) for dy in range(merge) for dx in range(merge))
        images.extend([h * w] * t)  # each frame attends within itself (transformers' cu_seqlens)
    return order, windows, images, positions


def _runs(lengths: list[int], device: torch.device) -> list[torch.Tensor]:
    """Consecutive runs of these lengths as index tensors (runs, length), one per distinct length: attention within
    each run batched by length (most windows of an image are full, the few at its right and bottom edges shorter),
    with no (patches, patches) mask."""
    starts: dict[int, list[int]] = {}
    first = 0
    for length in lengths:
        starts.setdefault(length, []).append(first)
        first += length
    return [torch.tensor(firsts, device=device)[:, None] + torch.arange(length, device=device)
            for length, firsts in starts.items()]  # fmt: skip
