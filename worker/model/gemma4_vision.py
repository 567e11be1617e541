"""Gemma 4's vision tower and its embedder into the language model: an image's patches -> one soft token per k x k
block of patches (k = pooling_kernel_size), the rows that replace its placeholder tokens.

Per image of grid (1, h, w) patches (pixel_values' rows one patch each, row-major, as the image processor makes them
once its padding is dropped: frontend/multimodal/vision.py), the patch at row y, column x:
- patch embedding: a linear over the patch's pixels taken to [-1, 1], plus learned x and y position embeddings;
- blocks of pre- and post-normed attention and GeGLU MLP (Gemma 3's sandwich), the attention bidirectional within the
  image, queries and keys RMS-normed per head and turned by a 2-D rotary (the head's first half by x, its second by
  y), values RMS-normed without a scale, softmax scale 1;
- the pooler: the k x k blocks averaged (soft tokens row-major over the block grid), times sqrt(hidden), optionally
  standardized (std_bias, std_scale), all in float32;
- the embedder (`embed_vision`): a weightless RMSNorm and a linear to the language model's width.
Several images go through in one call; none attends to another.

Sharded like the language model: attention heads and the MLP's width split over the ranks (column then row
parallel); the patch embedding, the pooler and the embedder are replicated. With use_clipped_linears each linear
clamps its input and output to the checkpoint's bounds (`input_min` ...)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraplex.worker.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from loraplex.worker.layers.norm import Gemma4RMSNorm
from loraplex.worker.model.config import Gemma4VisionConfig
from loraplex.worker.parallel import current_tp
from torch import nn


class ClippableLinear(nn.Module):
    """The checkpoint's `<name>.linear` with, when clipped, `<name>.input_min/max` and `output_min/max` bounds."""

    def __init__(self, linear: nn.Module, clipped: bool):
        super().__init__()
        self.linear = linear
        self.clipped = clipped
        if clipped:
            for name, fill in (("input_min", -1), ("input_max", 1), ("output_min", -1), ("output_max", 1)):
                bound = nn.Parameter(torch.tensor(fill * float("inf")), requires_grad=False)
                bound.dummy_fill = fill * float("inf")  # --load-format dummy: no clamping
                setattr(self, name, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        y = self.linear(torch.clamp(x, self.input_min, self.input_max))
        return torch.clamp(y, self.output_min, self.output_max)


class PatchEmbedder(nn.Module):
    def __init__(self, c: Gemma4VisionConfig):
        super().__init__()
        self.input_proj = ReplicatedLinear(c.in_channels * c.patch_size**2, c.hidden_size)
        self.position_embedding_table = nn.Parameter(torch.empty(2, c.position_embedding_size, c.hidden_size),
                                                     requires_grad=False)  # fmt: skip

    def forward(self, pixels: torch.Tensor, xy: torch.Tensor) -> torch.Tensor:
        """pixels (patches, patch dim) in [0, 1], xy (patches, 2) -> (patches, hidden)."""
        hidden = self.input_proj((2 * (pixels - 0.5)).to(self.position_embedding_table.dtype))
        table = self.position_embedding_table
        return hidden + table[0][xy[:, 0]] + table[1][xy[:, 1]]


class VisionAttention(nn.Module):
    def __init__(self, c: Gemma4VisionConfig):
        super().__init__()
        tp, clipped = current_tp().world_size, c.use_clipped_linears
        if c.num_heads % tp or c.num_kv_heads % tp:
            raise ValueError(f"the vision tower's {c.num_heads} heads / {c.num_kv_heads} KV heads do not split over "
                             f"{tp} ranks")  # fmt: skip
        self.head_dim, self.eps = c.head_dim, c.rms_norm_eps
        self.num_groups = c.num_heads // c.num_kv_heads
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = ClippableLinear(ColumnParallelLinear(c.hidden_size, q_size), clipped)
        self.k_proj = ClippableLinear(ColumnParallelLinear(c.hidden_size, kv_size), clipped)
        self.v_proj = ClippableLinear(ColumnParallelLinear(c.hidden_size, kv_size), clipped)
        self.o_proj = ClippableLinear(RowParallelLinear(q_size, c.hidden_size), clipped)
        self.q_norm = Gemma4RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = Gemma4RMSNorm(c.head_dim, c.rms_norm_eps)
        self.v_norm = Gemma4RMSNorm(c.head_dim, c.rms_norm_eps, with_weight=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        num = x.shape[0]
        q = _rotate(self.q_norm(self.q_proj(x).view(num, -1, self.head_dim)), cos, sin)  # (patches, heads, dim)
        k = _rotate(self.k_norm(self.k_proj(x).view(num, -1, self.head_dim)), cos, sin)  # (patches, kv_heads, dim)
        v = self.v_norm(self.v_proj(x).view(num, -1, self.head_dim))
        if self.num_groups > 1:
            k, v = k.repeat_interleave(self.num_groups, 1), v.repeat_interleave(self.num_groups, 1)
        out = torch.cat([
            F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (qi, ki, vi)), scale=1.0)[0]
            for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
        ], dim=1).transpose(0, 1)  # (patches, heads, dim): each image attends within itself
        return self.o_proj(out.reshape(num, -1))  # (patches, hidden)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each half of the head turned as a rotary of its own (rotate-half within it): the first by x, the second by y.
    cos, sin (patches, 1, head_dim)."""
    halves = []
    for part, c, s in zip(x.chunk(2, -1), cos.chunk(2, -1), sin.chunk(2, -1), strict=True):
        first, second = part.chunk(2, -1)
        halves.append(part * c + torch.cat((-second, first), -1) * s)
    return torch.cat(halves, -1)


class VisionMLP(nn.Module):
    def __init__(self, c: Gemma4VisionConfig):
        super().__init__()
        clipped = c.use_clipped_linears
        self.gate_proj = ClippableLinear(ColumnParallelLinear(c.hidden_size, c.intermediate_size), clipped)
        self.up_proj = ClippableLinear(ColumnParallelLinear(c.hidden_size, c.intermediate_size), clipped)
        self.down_proj = ClippableLinear(RowParallelLinear(c.intermediate_size, c.hidden_size), clipped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class VisionLayer(nn.Module):
    def __init__(self, c: Gemma4VisionConfig):
        super().__init__()
        self.self_attn = VisionAttention(c)
        self.mlp = VisionMLP(c)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):  # fmt: skip
            setattr(self, name, Gemma4RMSNorm(c.hidden_size, c.rms_norm_eps))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, lengths))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionEncoder(nn.Module):
    def __init__(self, c: Gemma4VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(c) for _ in range(c.depth))


class Gemma4VisionTower(nn.Module):
    """The checkpoint's `vision_tower`: patches -> pooled soft tokens (float32, before the embedder)."""

    def __init__(self, c: Gemma4VisionConfig):
        super().__init__()
        self.config = c
        self.patch_embedder = PatchEmbedder(c)
        self.encoder = VisionEncoder(c)
        if c.standardize:
            self.std_bias = nn.Parameter(torch.empty(c.hidden_size), requires_grad=False)
            self.std_scale = nn.Parameter(torch.empty(c.hidden_size), requires_grad=False)
        quarter = c.head_dim // 4  # frequencies per axis: each half of the head rotated by one axis
        self.register_buffer("inv_freq", 1.0 / c.rope_theta ** (
            torch.arange(0, 2 * quarter, 2, dtype=torch.float32) / (2 * quarter)), persistent=False)  # fmt: skip

    def forward(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        """pixels (patches of every image, patch dim), grids each image's (1, h, w) -> (soft tokens of every image in
        order, hidden) in float32."""
        c, device = self.config, pixels.device
        xy = torch.cat([_positions(h, w, device) for _, h, w in grids])  # (patches, 2): (x, y)
        x = self.patch_embedder(pixels, xy)  # (patches, hidden)
        angles = xy[:, :, None].float() * self.inv_freq  # (patches, 2, head_dim / 4)
        angles = torch.cat([angles[:, 0], angles[:, 0], angles[:, 1], angles[:, 1]], -1).unsqueeze(1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # (patches, 1, head_dim)
        lengths = [t * h * w for t, h, w in grids]
        for layer in self.encoder.layers:
            x = layer(x, cos, sin, lengths)
        pooled = torch.cat([_pool(image, h, w, c.spatial_merge_size)
                            for image, (_, h, w) in zip(x.split(lengths), grids, strict=True)])  # fmt: skip
        pooled = pooled * c.hidden_size**0.5  # (soft tokens, hidden) float32
        if c.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled


def _positions(h: int, w: int, device: torch.device) -> torch.Tensor:
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    return torch.stack([xs.flatten(), ys.flatten()], -1)  # (h * w, 2), row-major


def _pool(x: torch.Tensor, h: int, w: int, k: int) -> torch.Tensor:
    """(h * w, hidden) row-major -> (h/k * w/k, hidden) float32: each k x k block's mean, blocks row-major."""
    blocks = x.float().view(h // k, k, w // k, k, -1)
    return blocks.mean(dim=(1, 3)).flatten(0, 1)


class Gemma4VisionEmbedder(nn.Module):
    """The checkpoint's `embed_vision`: soft tokens into the language model's width."""

    def __init__(self, c: Gemma4VisionConfig):
        super().__init__()
        self.embedding_pre_projection_norm = Gemma4RMSNorm(c.hidden_size, c.rms_norm_eps, with_weight=False)
        self.embedding_projection = ReplicatedLinear(c.hidden_size, c.out_hidden_size)

    def forward(self, soft_tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """soft_tokens (tokens, vision hidden) float32 -> (tokens, text hidden) in the activation dtype."""
        return self.embedding_projection(self.embedding_pre_projection_norm(soft_tokens.to(dtype)))
