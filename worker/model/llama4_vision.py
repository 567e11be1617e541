"""Llama 4's vision model and multi-modal projector: image tiles -> the rows that replace their `<|patch|>`
placeholders in the language model.

Every tile (image_size pixels a side; the frontend cut the image into tiles and a global tile) is one sequence: its
patches (an unfold of patch x patch pixels, channels outermost, and one linear without bias), a class token after
them, learned position embeddings, a LayerNorm; encoder layers of pre-LayerNorm attention (q/k/v/o with biases,
bidirectional within the tile, a 2-D rotary: the first quarter of each head's (even, odd) pairs turned by the patch's
column + 1, the second quarter by its row + 1, the class token not at all) and a GELU MLP; a LayerNorm. The class
token is dropped, pixel shuffle folds each 2x2 of patches into one row of 4x the width, the adapter MLP (GELU after
each of its two linears) and the projector map them to the language model's width. Tiles never attend to each
other, so the tiles of several images (and of several requests) go through in one batch.

Sharded like the language model: attention heads and the MLPs' widths split over the ranks (column then row
parallel); the projector, one small linear, is whole on every rank."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraplex.worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from loraplex.worker.model.config import Llama4VisionConfig
from torch import nn

NORM_EPS = 1e-5  # nn.LayerNorm's default: the reference builds its LayerNorms without the config's norm_eps


def _layer_norm(size: int) -> nn.LayerNorm:
    norm = nn.LayerNorm(size, eps=NORM_EPS)
    norm.requires_grad_(False)
    return norm


class PatchEmbedding(nn.Module):
    def __init__(self, c: Llama4VisionConfig):
        super().__init__()
        self.patch_size = c.patch_size
        self.linear = ReplicatedLinear(c.in_channels * c.patch_size**2, c.hidden_size, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        patches = F.unfold(pixels.to(self.linear.weight.dtype), kernel_size=p, stride=p)  # (tiles, C*p*p, patches)
        return self.linear(patches.transpose(1, 2))  # (tiles, patches, hidden)


class VisionAttention(nn.Module):
    def __init__(self, c: Llama4VisionConfig):
        super().__init__()
        self.head_dim = c.head_dim
        self.qkv_proj = MergedColumnParallelLinear(c.hidden_size, [c.hidden_size] * 3, bias=True)  # q | k | v
        self.o_proj = RowParallelLinear(c.hidden_size, c.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tiles, length, _ = x.shape
        q, k, v = (t.view(tiles, length, -1, self.head_dim)
                   for t in self.qkv_proj(x).split(self.qkv_proj.output_sizes_per_rank, -1))  # fmt: skip
        q, k = _rotate_pairs(q, cos, sin), _rotate_pairs(k, cos, sin)  # (tiles, length, heads, head_dim)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o_proj(out.transpose(1, 2).reshape(tiles, length, -1))  # (tiles, length, hidden)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each (even, odd) pair of a head as a complex number times e^(i angle), in float32 as the reference.
    cos, sin: (length, 1, head_dim / 2)."""
    x32 = x.float()
    even, odd = x32[..., 0::2], x32[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).to(x.dtype)


class VisionMLP(nn.Module):
    def __init__(self, c: Llama4VisionConfig):
        super().__init__()
        self.fc1 = ColumnParallelLinear(c.hidden_size, c.intermediate_size, bias=True)
        self.fc2 = RowParallelLinear(c.intermediate_size, c.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, c: Llama4VisionConfig):
        super().__init__()
        self.input_layernorm = _layer_norm(c.hidden_size)
        self.self_attn = VisionAttention(c)
        self.post_attention_layernorm = _layer_norm(c.hidden_size)
        self.mlp = VisionMLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Encoder(nn.Module):
    def __init__(self, c: Llama4VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(c) for _ in range(c.num_layers))


class AdapterMLP(nn.Module):
    """The pixel-shuffled rows -> vision_output_dim: Linear, GELU, Linear, GELU (no biases)."""

    def __init__(self, c: Llama4VisionConfig):
        super().__init__()
        self.fc1 = ColumnParallelLinear(c.intermediate_size, c.projector_input_dim, bias=False)
        self.fc2 = RowParallelLinear(c.projector_input_dim, c.projector_output_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc2(F.gelu(self.fc1(x))))


class PixelShuffleAdapter(nn.Module):
    def __init__(self, c: Llama4VisionConfig):
        super().__init__()
        self.ratio = c.pixel_shuffle_ratio
        self.mlp = AdapterMLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(pixel_shuffle(x, self.ratio))


def pixel_shuffle(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """(tiles, side * side, C) -> (tiles, side * side * ratio**2, C / ratio**2), as the reference folds it: the
    width into the channels, transposed, the height into the channels, transposed back."""
    tiles, num_patches, channels = x.shape
    side = round(num_patches**0.5)
    x = x.reshape(tiles, side, int(side * ratio), int(channels / ratio)).transpose(1, 2)
    x = x.reshape(tiles, int(side * ratio), int(side * ratio), int(channels / ratio**2)).transpose(1, 2)
    return x.reshape(tiles, -1, x.shape[-1])


class Llama4VisionModel(nn.Module):
    def __init__(self, c: Llama4VisionConfig):
        super().__init__()
        c.check()
        self.config = c
        num_positions = c.patches_per_side**2 + 1
        self.patch_embedding = PatchEmbedding(c)
        self.class_embedding = nn.Parameter(torch.empty(c.hidden_size), requires_grad=False)
        self.positional_embedding_vlm = nn.Parameter(torch.empty(num_positions, c.hidden_size), requires_grad=False)
        self.layernorm_pre = _layer_norm(c.hidden_size)
        self.layernorm_post = _layer_norm(c.hidden_size)
        self.model = Encoder(c)
        self.vision_adapter = PixelShuffleAdapter(c)
        self.register_buffer("angles", _angles(c), persistent=False)  # (patches + 1, head_dim / 2)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (tiles, channels, image_size, image_size) -> (tiles, tokens_per_tile, vision_output_dim)."""
        x = self.patch_embedding(pixels)  # (tiles, patches, hidden)
        x = torch.cat((x, self.class_embedding.to(x.dtype).expand(x.shape[0], 1, -1)), dim=1)
        x = self.layernorm_pre(x + self.positional_embedding_vlm.to(x.dtype))  # (tiles, patches + 1, hidden)
        angles = self.angles.to(x.device)[:, None, :]  # (patches + 1, 1, head_dim / 2)
        cos, sin = angles.cos(), angles.sin()
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.layernorm_post(x)[:, :-1]  # the class token dropped
        return self.vision_adapter(x)


def _angles(c: Llama4VisionConfig) -> torch.Tensor:
    """Each position's rotary angle per (even, odd) pair: the patches row-major, then the class token (0)."""
    side = c.patches_per_side
    quarter = c.head_dim // 4
    inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, 2 * quarter, 2).float() / (2 * quarter))  # (head_dim / 4,)
    index = torch.arange(side * side)
    column, row = (index % side + 1).float(), (index // side + 1).float()
    angles = torch.cat((column[:, None] * inv_freq, row[:, None] * inv_freq), dim=-1)  # (patches, head_dim / 2)
    return torch.cat((angles, torch.zeros(1, angles.shape[1])))


class Llama4Projector(nn.Module):
    def __init__(self, c: Llama4VisionConfig):
        super().__init__()
        self.linear_1 = ReplicatedLinear(c.vision_output_dim, c.out_hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_1(x)
