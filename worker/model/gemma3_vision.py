"""Gemma 3's vision side: the SigLIP vision tower and the multi-modal projector, pixels -> the mm_tokens_per_image rows
that replace an image's placeholder tokens in the language model.

The tower (transformers' SiglipVisionModel, vision_use_head False): every image is one image_size square; its patches
(the checkpoint's Conv2d with stride = kernel, here one matmul over the unfolded patches) plus a learned position
embedding per patch; pre-norm blocks of LayerNorm, full bidirectional attention over the image's patches (q/k/v with
biases, out_proj) and a tanh-GELU MLP (fc1, fc2); a last LayerNorm. The projector (Gemma3MultiModalProjector):
average pooling of the patch grid to tokens_per_side x tokens_per_side, Gemma's RMSNorm (1 + w), then one matmul by
mm_input_projection_weight (vision hidden, text hidden).

Sharded like the language model: attention heads and the MLP's width split over the ranks (q/k/v and fc1 column
parallel, out_proj and fc2 row parallel); embeddings, norms and the projector are whole on every rank. Module names
are the checkpoint's (vision_tower.* as transformers 5 saves it, multi_modal_projector.*)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraplex.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from loraplex.worker.layers.norm import GemmaRMSNorm
from loraplex.worker.model.config import SiglipVisionConfig
from torch import nn


class SiglipEmbeddings(nn.Module):
    def __init__(self, c: SiglipVisionConfig):
        super().__init__()
        self.patch_size = c.patch_size
        # the checkpoint's Conv2d (hidden, channels, patch, patch) with its bias; kernel = stride: one matmul
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = nn.Parameter(
            torch.empty(c.hidden_size, c.in_channels, c.patch_size, c.patch_size), requires_grad=False)  # fmt: skip
        self.patch_embedding.bias = nn.Parameter(torch.empty(c.hidden_size), requires_grad=False)
        self.position_embedding = nn.Embedding(c.patches_per_side**2, c.hidden_size)
        self.position_embedding.weight.requires_grad_(False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(images, channels, H, W) -> (images, patches, hidden), patches row-major as the Conv2d's output flattens."""
        p = self.patch_size
        weight = self.patch_embedding.weight
        patches = F.unfold(pixels.to(weight.dtype), kernel_size=p, stride=p)  # (images, channels*p*p, patches)
        x = patches.transpose(1, 2) @ weight.view(weight.shape[0], -1).t() + self.patch_embedding.bias
        return x + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, c: SiglipVisionConfig):
        super().__init__()
        self.head_dim = c.head_dim
        dim = c.hidden_size
        self.q_proj = ColumnParallelLinear(dim, dim, bias=True)
        self.k_proj = ColumnParallelLinear(dim, dim, bias=True)
        self.v_proj = ColumnParallelLinear(dim, dim, bias=True)
        self.out_proj = RowParallelLinear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, num_images: int) -> torch.Tensor:
        """x (images * patches, hidden): each image attends over its own patches, both ways."""
        q, k, v = (proj(x).view(num_images, -1, proj.output_sizes_per_rank[0] // self.head_dim, self.head_dim)
                   .transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v)  # (images, heads, patches, head_dim)
        return self.out_proj(out.transpose(1, 2).reshape(x.shape[0], -1))


class SiglipMLP(nn.Module):
    def __init__(self, c: SiglipVisionConfig):
        super().__init__()
        self.fc1 = ColumnParallelLinear(c.hidden_size, c.intermediate_size, bias=True)
        self.fc2 = RowParallelLinear(c.intermediate_size, c.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, c: SiglipVisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.self_attn = SiglipAttention(c)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = SiglipMLP(c)

    def forward(self, x: torch.Tensor, num_images: int) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), num_images)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, c: SiglipVisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(c) for _ in range(c.depth))


class SiglipVisionModel(nn.Module):
    def __init__(self, c: SiglipVisionConfig):
        super().__init__()
        self.embeddings = SiglipEmbeddings(c)
        self.encoder = SiglipEncoder(c)
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """(images, channels, H, W) -> (images, patches, hidden)."""
        x = self.embeddings(pixels)
        num_images, num_patches, hidden = x.shape
        x = x.reshape(-1, hidden)  # flat rows: the linears (and the tower's LoRA rows) see (rows, features)
        for layer in self.encoder.layers:
            x = layer(x, num_images)
        return self.post_layernorm(x).view(num_images, num_patches, hidden)


class MultiModalProjector(nn.Module):
    def __init__(self, c: SiglipVisionConfig):
        super().__init__()
        self.side, self.kernel = c.patches_per_side, c.spatial_merge_size
        self.mm_soft_emb_norm = GemmaRMSNorm(c.hidden_size, c.layer_norm_eps)
        self.mm_input_projection_weight = nn.Parameter(torch.empty(c.hidden_size, c.out_hidden_size),
                                                       requires_grad=False)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(images, patches, hidden) -> (images * mm_tokens_per_image, text hidden)."""
        num_images, _, hidden = x.shape
        grid = x.transpose(1, 2).reshape(num_images, hidden, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # (images, tokens, hidden)
        out = self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight.to(x.dtype)
        return out.reshape(-1, out.shape[-1])


def check_image_shape(shape: list[int], c: SiglipVisionConfig) -> str:
    """Why pixel_values of this shape are not one image for the tower, or "" when they are."""
    expected = [1, c.in_channels, c.image_size, c.image_size]
    return "" if list(shape) == expected else f"image pixel_values of shape {list(shape)}, expected {expected}"
