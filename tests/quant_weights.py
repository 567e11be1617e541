"""Random quantized weights for the kernel tests (no tests here)."""

from __future__ import annotations

import torch
from loraplex.worker.quant.weights import IntWeight


def random_int_weight(bits: int, group_size: int, signed: bool, zeros: bool, act_order: bool,
                      out_features: int = 48, in_features: int = 128) -> IntWeight:
    """An IntWeight of random values, scales and zero points (act order: groups of shuffled columns)."""
    gen = torch.Generator().manual_seed(bits + group_size)
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1)) if signed else (0, 2**bits)
    q = torch.randint(low, high, (out_features, in_features), generator=gen)
    num_groups = in_features // group_size
    g_idx = torch.arange(in_features) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(in_features, generator=gen)]
    z = torch.randint(low, high, (out_features, num_groups), generator=gen).to(torch.int32) if zeros else None
    return IntWeight(q=q.to(torch.int8 if signed else torch.uint8), scales=torch.rand(out_features, num_groups) / 10,
                     zeros=z, g_idx=g_idx if act_order else None, group_size=group_size, bits=bits)
