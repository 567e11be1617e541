"""The paged KV cache tensors of this rank, and the default rule for their size.

Pages are allocated by the scheduler; here a page is just `page_size` consecutive slots, and token position p of a
request lives at slot `page_ids[p // page_size] * page_size + p % page_size`.
"""

from __future__ import annotations

import logging

import psutil
import torch

logger = logging.getLogger(__name__)

MAX_DEFAULT_TOKENS = 2**18
CPU_MEMORY_FRACTION = 0.20  # of available host memory
CUDA_MEMORY_FRACTION = 0.85  # of free device memory, measured after the weights are loaded


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
        leading part the attention reads as its values)."""
        self.num_pages = num_pages  # the scheduler's pages, 0..num_pages - 1
        self.page_size = page_size
        # One more page, past the scheduler's, where the padding rows of a CUDA graph's batch write and read.
        self.scratch_page = num_pages
        num_slots = (num_pages + 1) * page_size
        # Zeroed, not empty: masked-out keys still meet their values in SDPA, and 0 * NaN garbage would be NaN.
        self.kv = torch.zeros(
            num_layers, num_parts, num_slots, num_kv_heads, head_dim, dtype=dtype, device=device
        )  # (layers, k|v or one part, slots, kv_heads, head_dim)

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[layer_id, 0], self.kv[layer_id, -1]  # each (slots, kv_heads, head_dim); one tensor if one part


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
