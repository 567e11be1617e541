"""Rotary position embedding (rotate-half layout) with a precomputed cos/sin table."""

from __future__ import annotations

import math

import torch
from loraplex.worker.layers.ops import current_ops
from loraplex.worker.model.config import RopeConfig
from torch import nn


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.params["factor"]
    if rope.rope_type == "llama3":
        return _llama3_frequencies(inv_freq, rope.params)
    return inv_freq  # (head_dim / 2,)


def _llama3_frequencies(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    # Llama 3.1 context extension: long wavelengths are slowed by `factor`, short ones kept, and the band
    # between the two cut-offs is interpolated smoothly.
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    original_len = params["original_max_position_embeddings"]
    low_freq_wavelen = original_len / low_freq_factor
    high_freq_wavelen = original_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, rope).to(torch.get_default_device())
        positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(positions, inv_freq)  # (max_positions, head_dim / 2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (max_positions, head_dim)
        # fp32 tables, cast to the activations' dtype at use, matching the reference's rounding.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.ops = current_ops()  # bound at construction: the worker's choice, made once at start-up

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q (tokens, heads, head_dim), k (tokens, kv_heads, head_dim): rotated, possibly in place
        return self.ops.rotary_embedding(positions, q, k, self.cos, self.sin)
