"""Sub-byte integers packed into int32 words, as GPTQ and AWQ checkpoints store them: word k holds the values of
`pack = 32 // bits` consecutive elements along one dimension, element j of the word in bits [j·bits, (j+1)·bits),
or in AWQ's interleaved order. Both directions live here: the loader unpacks; the formats' `encode` (for
--load-format dummy) and the tests' checkpoint writer pack."""

from __future__ import annotations

import torch

# AWQ's GEMM kernels read word nibble j as output column AWQ_ORDER[j] of its group of 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words -> unsigned values (uint8), `32 // bits` per word along `dim`, each word's values in `order`."""
    pack = 32 // bits
    shifts = torch.arange(pack, dtype=torch.int32, device=packed.device) * bits
    words = packed.to(torch.int32).movedim(dim, -1).unsqueeze(-1)  # (..., words, 1)
    values = (words >> shifts) & ((1 << bits) - 1)  # (..., words, pack): nibble j of each word
    if order is not None:
        positions = torch.tensor([order.index(j) for j in range(pack)], device=packed.device)
        values = values[..., positions]  # position j holds element j
    return values.flatten(-2).movedim(-1, dim).to(torch.uint8)


def pack_int32(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of unpack_int32: unsigned values in [0, 2**bits) -> int32 words along `dim`."""
    pack = 32 // bits
    v = values.movedim(dim, -1)
    if v.shape[-1] % pack:
        raise ValueError(f"{v.shape[-1]} values do not fill whole words of {pack}")
    v = v.reshape(*v.shape[:-1], -1, pack)  # (..., words, pack)
    words = torch.zeros(v.shape[:-1], dtype=torch.int32, device=v.device)
    for j, element in enumerate(order or range(pack)):  # nibble j holds element order[j]
        # int32 shifts wrap: the top value lands in the sign bit, as the two's-complement word stores it
        words |= v[..., element].to(torch.int32) << (j * bits)
    return words.movedim(-1, dim)
