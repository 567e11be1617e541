"""Linear weights prepacked for oneDNN, on the CPU in bfloat16.

F.linear hands oneDNN a plain (out, in) weight, and oneDNN's AMX matmul copies it into its blocked layout on every
call: in a decode step that copy is a second pass over every weight. Reordered once at start-up, the weight is read
once per matmul (measured on the bench model: decode steps 5-15% faster, a decode step beside a prefill 10-20%),
with bit-identical results. The plain weight is freed once packed, so the model takes no more memory.

A linear opts in with a `packed_weight` attribute (None until packed) and computes through `linear` below; one whose
model code reads its plain weight (latent attention's kv_b_proj) opts out with `packable = False`.

Where kernels/cpu_gemv.py's kernels are chosen for bfloat16 (by default wherever a build runs: AVX-512 BF16 or AVX2;
LORAPLEX_CPU_GEMV=off keeps oneDNN) the linears take them instead, reading each weight once per call: `use_gemv` lays
the weights out for them. On AVX-512 the blocked layout replaces the plain weight and takes every row count; the AVX2
build takes decode rows (up to 32) from the plain weight, which torch's GEMM reads above that."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from loraplex.kernels import cpu_gemv
from torch import nn

logger = logging.getLogger(__name__)


def unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the weights cannot be prepacked here, or None if they can."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return f"only for bfloat16 on the CPU, not {str(dtype).removeprefix('torch.')} on {device.type}"
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "this torch build or CPU has no oneDNN bfloat16 matmul"
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None = None,
           gemv: cpu_gemv.PackedWeight | None = None):
    """x Wᵀ + b: by cpu_gemv with `gemv` (use_gemv's layout; the AVX2 build up to 32 rows), else from the
    oneDNN-packed weight where there is one."""
    if gemv is not None and cpu_gemv.takes_rows(gemv, x.numel() // x.shape[-1]):
        y = cpu_gemv.gemv(x.reshape(-1, x.shape[-1]), gemv, bias)  # the bias before the one rounding, as oneDNN's
        return y.view(*x.shape[:-1], -1)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack_linears(model: nn.Module) -> int:
    """Pack the weight of every opted-in linear that owns a plain weight (a tied LM head shares the embedding's, which
    must stay plain; a quantized linear has its own layout); returns how many were packed."""
    num_packed = 0
    for module in model.modules():
        if not hasattr(module, "packed_weight") or getattr(module, "tied", False) or module.packed_weight is not None:
            continue
        if getattr(module, "quant", None) is not None or not getattr(module, "packable", True):
            continue
        weight = module.weight
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        weight.data = weight.data.new_empty(0)  # the packed copy replaces it
        num_packed += 1
    return num_packed


def gemv_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why bfloat16 linears do not take cpu_gemv's decode kernel here, or None if they do."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return f"only for bfloat16 on the CPU, not {str(dtype).removeprefix('torch.')} on {device.type}"
    if not cpu_gemv.chosen():
        return "LORAPLEX_CPU_GEMV=off, or the CPU lacks AVX2/FMA/F16C"
    return None if cpu_gemv.kernels() is not None else f"the {cpu_gemv.isa().name} kernels failed to build"


def use_gemv(model: nn.Module) -> int:
    """Lay out every linear that owns a plain bfloat16 weight (as pack_linears chooses them) for cpu_gemv's kernels,
    which then compute its rows (on AVX2: up to 32); returns how many. A blocked copy replaces the plain weight where
    nothing else reads it (not a tied LM head's, nor one that opts out of packing)."""
    num_marked = 0
    for module in model.modules():
        if not hasattr(module, "packed_weight") or getattr(module, "quant", None) is not None:
            continue
        weight = getattr(module, "weight", None)
        if weight is None or weight.dtype != torch.bfloat16 or weight.dim() != 2 or not weight.is_contiguous():
            continue
        module.gemv = cpu_gemv.pack_bf16(weight.detach())
        if module.gemv.blocked and not getattr(module, "tied", False) and getattr(module, "packable", True):
            weight.data = weight.data.new_empty(0)
        num_marked += 1
    return num_marked
