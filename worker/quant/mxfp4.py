"""MXFP4 experts (gpt-oss's published checkpoints, quant_method "mxfp4"): only the MoE experts are quantized; the
attention, router, embeddings and head stay plain (`modules_to_not_convert`).

Each expert linear is stored as `<proj>_blocks` (experts, out, in / 32, 16) uint8 and `<proj>_scales` (experts, out,
in / 32) uint8, rows in (out, in) order (gate_up's rows interleaved gate/up, as the plain checkpoints'). A block is 32
consecutive inputs of one row: 16 bytes of two e2m1 values each (the low nibble is the even input, the high nibble the
odd one), and one e8m0 scale byte s, so value = E2M1[nibble] * 2 ** (s - 127). E2M1's 16 codes: sign bit 3, then
0, 0.5, 1, 1.5, 2, 3, 4, 6.

The experts keep the packed bytes resident (4.25 bits per weight) and dequantize one expert's weight when its rows
are multiplied (worker/layers/moe.py's ExpertsLinear): on the CPU the expert's whole weight in torch ops (`dequantize`),
on CUDA tile by tile inside the Triton matmul (kernels/mxfp4_matmul.py)."""

from __future__ import annotations

import math
from typing import Any

import torch

BLOCK_SIZE = 32  # inputs per scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
_E2M1_STD = math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))  # of a uniformly drawn code


class Mxfp4Format:
    """The checkpoint's format as the worker holds it: it names the quantized modules (the experts), and builds no
    quantized linear (`experts_only`: the decoder's linears load plain)."""

    method = "mxfp4"
    description = "mxfp4 experts (e2m1 in blocks of 32 with e8m0 scales)"
    experts_only = True
    tensor_names = ("blocks", "scales")

    def __init__(self, config: dict[str, Any]):
        self.config = config

    def quantizes(self, module_name: str) -> bool:
        return ".experts." in module_name or module_name.endswith(".experts")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(rows, in / 2) uint8 codes, (rows, in / 32) uint8 exponents -> (rows, in) weights in `dtype`."""
    num_rows, num_bytes = blocks.shape
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).view(num_rows, 2 * num_bytes)  # low nibble first
    values = table[codes.long()].view(num_rows, -1, BLOCK_SIZE)  # (rows, blocks, 32)
    exponents = scales.to(torch.int32) - E8M0_BIAS  # (rows, blocks)
    return torch.ldexp(values, exponents[..., None]).view(num_rows, -1).to(dtype)


def random_blocks(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    """Uniform codes (--load-format dummy); `random_scales` makes their dequantized std ~ `std`."""
    return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8, device=generator.device)


def random_scales(shape: tuple[int, ...], std: float, generator: torch.Generator) -> torch.Tensor:
    exponent = round(math.log2(std / _E2M1_STD))
    return torch.full(shape, E8M0_BIAS + exponent, dtype=torch.uint8, device=generator.device)
