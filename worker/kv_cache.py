"""The paged KV cache tensors of this rank, and the default rule for their size.

Pages are allocated by the scheduler; here a page is just `page_size` consecutive slots, and token position p of a
request lives at slot `page_ids[p // page_size] * page_size + p % page_size`.

An FP8 cache (--kv-cache-dtype fp8) stores float8_e4m3fn values = K / k_scale and V / v_scale, one scale per layer
for keys and one for values (per tensor, as vLLM and llm-compressor's kv_cache_scheme keep them); every attention
backend multiplies them back as it reads. The scales come from the checkpoint, from the first prefill
(--calculate-kv-scales), or are 1.0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

logger = logging.getLogger(__name__)

MAX_DEFAULT_TOKENS = 2**18
CPU_MEMORY_FRACTION = 0.20  # of available host memory
CUDA_MEMORY_FRACTION = 0.85  # of free device memory, measured after the weights are loaded


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest float8_e4m3fn
# --calculate-kv-scales: scale = first prefill's amax / this, room for later keys and values up to 448 / 224 = 2x
# larger before they saturate
FP8_CALIBRATION_RANGE = 224.0


@dataclass
class KVScales:
    """One layer's scales of an FP8 cache: stored = value / scale. `values` is a view of the cache's table, so a
    change (checkpoint, calibration) reaches every holder, CUDA graphs included."""

    values: torch.Tensor  # (2,) float32: keys', values'
    owner: KVCache

    @property
    def k_scale(self) -> torch.Tensor:
        return self.values[0:1]  # (1,)

    @property
    def v_scale(self) -> torch.Tensor:
        return self.values[1:2]  # (1,)

    @property
    def is_calibrating(self) -> bool:
        return self.owner.is_calibrating


class KVLayer(tuple):
    """(k_cache, v_cache) of one layer, as the models unpack it, and `scales`: an FP8 cache's, or None when the
    cache holds the values themselves."""

    scales: KVScales | None

    def __new__(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, scales: KVScales | None = None) -> KVLayer:
        self = super().__new__(cls, (k_cache, v_cache))
        self.scales = scales
        return self


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_parts: int = 2,
    ):
        """num_parts 2: keys and values; 1: one tensor that is both (latent attention's latent + rope key, whose
        leading part the attention reads as its values). dtype FP8_DTYPE: an FP8 cache, its scales 1.0 until
        set_scales or a calibrating pass."""
        self.num_pages = num_pages  # the scheduler's pages, 0..num_pages - 1
        self.page_size = page_size
        # One more page, past the scheduler's, where the padding rows of a CUDA graph's batch write and read.
        self.scratch_page = num_pages
        num_slots = (num_pages + 1) * page_size
        # Zeroed, not empty: masked-out keys still meet their values in SDPA, and 0 * NaN garbage would be NaN.
        self.kv = torch.zeros(
            num_layers, num_parts, num_slots, num_kv_heads, head_dim, dtype=dtype, device=device
        )  # (layers, k|v or one part, slots, kv_heads, head_dim)
        self.is_fp8 = dtype == FP8_DTYPE
        self.scales = torch.ones(num_layers, 2, dtype=torch.float32, device=device)  # (layers, k|v); FP8 only
        self._layer_scales = [KVScales(self.scales[i], self) for i in range(num_layers)] if self.is_fp8 else None
        # True for one pass (ModelRunner's first prefill under --calculate-kv-scales): paged_attention sets each
        # layer's scales from that pass's keys and values before writing them
        self.is_calibrating = False

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def layer(self, layer_id: int) -> KVLayer:
        scales = self._layer_scales[layer_id] if self._layer_scales is not None else None
        # each (slots, kv_heads, head_dim); one tensor if one part
        return KVLayer(self.kv[layer_id, 0], self.kv[layer_id, -1], scales)

    def set_scales(self, scales: torch.Tensor) -> None:
        """(layers, 2) float32 keys' and values' scales (the checkpoint's)."""
        self.scales.copy_(scales)


def write_kv(
    k: torch.Tensor,  # (tokens, kv_heads, head_dim)
    v: torch.Tensor,  # (tokens, kv_heads, head_dim)
    k_cache: torch.Tensor,  # (slots, kv_heads, head_dim)
    v_cache: torch.Tensor,
    write_slots: torch.Tensor,  # (tokens,)
    scales: KVScales | None,
) -> None:
    """The new tokens' keys and values into their slots; an FP8 cache's divided by its scales (saturating at 448:
    the cast would make larger ones NaN), after a calibrating pass sets the scales from them."""
    if scales is None:
        k_cache.index_copy_(0, write_slots, k)
        v_cache.index_copy_(0, write_slots, v)
        return
    if scales.is_calibrating:
        amax = torch.stack([k.abs().amax(), v.abs().amax()]).float()  # (2,)
        # an all-zero pass (padding) keeps scale 1.0 rather than 0
        scales.values.copy_(torch.where(amax > 0, amax / FP8_CALIBRATION_RANGE, torch.ones_like(amax)))
    # as bytes: torch's CPU index ops take no float8
    k_cache.view(torch.uint8).index_copy_(0, write_slots, quantize_fp8(k, scales.k_scale).view(torch.uint8))
    v_cache.view(torch.uint8).index_copy_(0, write_slots, quantize_fp8(v, scales.v_scale).view(torch.uint8))


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale as float8_e4m3fn, saturated to its range; scale (1,) float32."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn x -> x * scale in dtype (the float32 product rounded once)."""
    return (x.float() * scale).to(dtype)


def kv_cache_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype's storage dtype; ValueError (one line) where the model's dtype cannot use it."""
    if choice in ("fp8", "fp8_e4m3"):
        return FP8_DTYPE
    if choice == "bfloat16" and model_dtype != torch.bfloat16:
        raise ValueError(f"--kv-cache-dtype bfloat16 holds the model's own dtype only: give --dtype bfloat16 (the "
                         f"model runs {str(model_dtype).removeprefix('torch.')}), or fp8 / auto")
    return model_dtype


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_parts: int = 2
) -> int:
    """Of one rank's cache (ModelConfig.kv_layout gives the parts, heads and head_dim)."""
    return num_parts * num_layers * num_kv_heads * head_dim * dtype.itemsize


def default_kv_tokens(
    *,
    max_running_requests: int,
    context_length: int,
    bytes_per_token: int,
    device: torch.device,
    gpu_memory_utilization: float | None = None,
    reserved_bytes: int = 0,
) -> int:
    """Enough for every running request at full context, capped by a share of memory and by MAX_DEFAULT_TOKENS.

    On CUDA with `gpu_memory_utilization` (vLLM's meaning: the share of the whole device this server may use), the
    KV cache gets that share of the device less what is in use already (the weights, loaded before this runs).
    `reserved_bytes`: what else takes its memory from the same share, allocated beside the KV cache (a hybrid
    model's state slots), so the KV cache gets the rest."""
    if device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        if gpu_memory_utilization is None:
            budget = int(free_bytes * CUDA_MEMORY_FRACTION)
        else:
            budget = max(0, int(total_bytes * gpu_memory_utilization) - (total_bytes - free_bytes))
    else:
        budget = int(psutil.virtual_memory().available * CPU_MEMORY_FRACTION)
    budget = max(0, budget - reserved_bytes)
    wanted = max_running_requests * context_length
    return min(wanted, budget // bytes_per_token, MAX_DEFAULT_TOKENS)
