"""Rotary position embedding (rotate-half layout) with precomputed cos/sin tables, one row per position.

Every RoPE scaling of transformers' modeling_rope_utils that the Llama-family models use lives in the tables: their
inverse frequencies and their attention factor (yarn, longrope scale cos and sin). What transformers decides per forward
from the sequence length:
  dynamic   frequencies of seq_len max(len, max_position_embeddings): the served context never exceeds the model's
            maximum (model_runner checks --context-length), so these are the ones at that maximum.
  longrope  the short factors while the sequence is at most original_max_position_embeddings long, the long ones at
            every position once it is longer (Phi-3's generate() then re-encodes the whole sequence). The tables hold
            both sets, short rows then long rows; the scheduler marks a request long (ForwardReq.long_rope, whose rows
            batch_inputs.rotary_row picks) and recomputes it when it passes that length.
M-RoPE (Qwen2.5-VL, rope params `mrope_section`): positions come as 3 rows (time, height, width) and the rotary
frequencies are split by mrope_section, the k-th group turned by row k's position (transformers'
apply_multimodal_rotary_pos_emb); with `mrope_interleaved` (Qwen3-VL) the rows take the frequencies in turn instead
of in runs; 1-D positions turn every group by the same position, which is plain RoPE.
Partial rotary (partial_rotary_factor < 1) rotates the first rotary_dim features of each head and passes the rest;
Gemma 4's `proportional` rope instead rotates whole heads, its trailing frequencies zero."""

from __future__ import annotations

import math

import torch
from loraplex.worker.layers.ops import current_ops
from loraplex.worker.model.config import RopeConfig
from torch import nn


def _default_frequencies(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # (dim / 2,)


def inverse_frequencies(rotary_dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (rotary_dim / 2,), attention factor) at positions within the model's original length, as
    transformers' rope init function of rope.rope_type returns them (seq_len None)."""
    params = rope.params
    if rope.rope_type == "linear":
        return _default_frequencies(rotary_dim, rope.theta) / params["factor"], 1.0
    if rope.rope_type == "llama3":
        return _llama3_frequencies(_default_frequencies(rotary_dim, rope.theta), params), 1.0
    if rope.rope_type == "yarn":
        return _yarn_frequencies(rotary_dim, rope)
    if rope.rope_type == "longrope":
        return _longrope_frequencies(rotary_dim, rope, params["short_factor"])
    if rope.rope_type == "dynamic":
        return _dynamic_frequencies(rotary_dim, rope), 1.0
    if rope.rope_type == "proportional":
        return _proportional_frequencies(rotary_dim, rope), 1.0
    return _default_frequencies(rotary_dim, rope.theta), 1.0


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


def _proportional_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    # Gemma 4's full layers: the first rope_proportion of the head's frequency pairs turn at the default rates of the
    # whole head_dim, the rest not at all (zero: those pairs pass unrotated), all divided by `factor`.
    num_rotated = int(rope.params["rope_proportion"] * head_dim // 2)
    rotated = 1.0 / (rope.theta ** (torch.arange(0, 2 * num_rotated, 2, dtype=torch.int64).float() / head_dim))
    inv_freq = torch.cat((rotated, torch.zeros(head_dim // 2 - num_rotated)))
    return inv_freq / rope.params.get("factor", 1.0)  # (head_dim / 2,)


def _dynamic_frequencies(dim: int, rope: RopeConfig) -> torch.Tensor:
    # Dynamic NTK at seq_len = max_position_embeddings (the base grows only past it; see the module's note).
    max_len, factor = rope.max_position_embeddings, rope.params["factor"]
    seq_len = max_len
    base = rope.theta * ((factor * seq_len / max_len) - (factor - 1)) ** (dim / (dim - 2))
    return _default_frequencies(dim, base)


def _yarn_frequencies(dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    # YaRN: frequencies that turn fewer than beta_slow times over the original length are interpolated (divided
    # by factor), those that turn more than beta_fast times kept, a linear ramp between; cos/sin scaled by mscale.
    params = rope.params
    original_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or rope.max_position_embeddings / original_len
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_len / (num_rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: interpolate it
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope_frequencies(dim: int, rope: RopeConfig, ext_factors: list[float]) -> tuple[torch.Tensor, float]:
    params = rope.params
    original_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or rope.max_position_embeddings / original_len
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_len))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * rope.theta**exponents), attention_factor


def rope_angles(rotary_dim: int, max_positions: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """(angles (sets * max_positions, rotary_dim / 2) of each row's rotation, attention factor), computed in float32
    on the CPU as transformers computes them; one set of rows, or two for longrope (short, then long)."""
    inv_freq, attention_factor = inverse_frequencies(rotary_dim, rope)
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (max_positions, rotary_dim / 2)
    if rope.rope_type == "longrope":
        long_inv_freq, _ = _longrope_frequencies(rotary_dim, rope, rope.params["long_factor"])
        angles = torch.cat((angles, torch.outer(positions, long_inv_freq)))  # (2 * max_positions, rotary_dim / 2)
    return angles, attention_factor


def _mrope_column_rows(section: list[int], interleaved: bool) -> torch.Tensor:
    """(rotary_dim / 2,): the position row (0 time, 1 height, 2 width) that turns each frequency. Qwen2.5-VL's
    sections are runs (section[0] frequencies of row 0, then row 1's, then row 2's); Qwen3-VL's interleaved ones cycle
    t, h, w over the first 3 * section[1] frequencies (h at 1, 4, ...; w at 2, 5, ... up to 3 * section[2]) and give
    the rest to t, as transformers' Qwen3VLTextRotaryEmbedding.recomposition_frequencies lays them out."""
    if not interleaved:
        return torch.repeat_interleave(torch.arange(len(section)) % 3, torch.tensor(section))
    rows = torch.zeros(sum(section), dtype=torch.int64)
    for row in (1, 2):
        rows[row : 3 * section[row] : 3] = row
    return rows


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        self.rotary_dim = rope.rotary_dim(head_dim)
        angles, attention_factor = rope_angles(self.rotary_dim, max_positions, rope)
        angles = torch.cat((angles, angles), dim=-1).to(torch.get_default_device())  # (rows, rotary_dim)
        # fp32 tables, cast to the activations' dtype at use, matching the reference's rounding.
        self.register_buffer("cos", angles.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", angles.sin() * attention_factor, persistent=False)
        self.ops = current_ops()  # bound at construction: the worker's choice, made once at start-up
        section = rope.params.get("mrope_section")
        self.mrope_rows: torch.Tensor | None = None  # M-RoPE: each column's position row (0, 1, 2)
        if section is not None:
            if 2 * sum(section) != self.rotary_dim:
                raise ValueError(f"mrope_section {section} does not split {self.rotary_dim // 2} rotary frequencies")
            rows = _mrope_column_rows(section, bool(rope.params.get("mrope_interleaved", False)))
            self.mrope_rows = torch.cat((rows, rows)).to(self.cos.device)  # (rotary_dim,): both rotate-half halves
        # the last 3-row positions and the per-token tables made for them: every layer of a forward shares them
        self._mrope_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _mrope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token indices, cos, sin): per-token (tokens, rotary_dim) tables for 3-row positions (3, tokens), each
        column read at its row's position, and the rows of those tables each token takes (itself)."""
        cached = self._mrope_cache
        if cached is not None and cached[0] is positions:
            return cached[1:]
        if self.mrope_rows is None:
            raise ValueError("3-row (M-RoPE) positions for a model whose rope has no mrope_section")
        index = positions[self.mrope_rows].t()  # (tokens, rotary_dim): each column's position
        tables = (torch.arange(positions.shape[1], device=positions.device),
                  self.cos.gather(0, index), self.sin.gather(0, index))  # fmt: skip
        self._mrope_cache = (positions, *tables)
        return tables

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions (tokens,): rows of the tables, or M-RoPE's (3, tokens); q (tokens, heads, head_dim),
        # k (tokens, kv_heads, head_dim): rotated, possibly in place
        cos, sin = self.cos, self.sin
        if positions.dim() == 2:
            positions, cos, sin = self._mrope_tables(positions)
        rotary_dim = self.rotary_dim
        if rotary_dim == q.shape[-1]:
            return self.ops.rotary_embedding(positions, q, k, cos, sin)
        # (tokens, heads, rotary_dim) each
        q_rot, k_rot = self.ops.rotary_embedding(positions, q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)
        return torch.cat((q_rot, q[..., rotary_dim:]), dim=-1), torch.cat((k_rot, k[..., rotary_dim:]), dim=-1)
