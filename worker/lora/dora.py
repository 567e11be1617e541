"""DoRA (PEFT's use_dora): each targeted module's output rows rescaled,
y = (x·Wᵀ + scale·(x·Aᵀ)·Bᵀ) · m / ‖W + scale·B·A‖, the norm of each output row over the input dim, as
peft.tuners.lora.dora.DoraLinearLayer computes it in eval mode (no dropout; the norm a constant). The bias is added
after the rescale, as PEFT leaves it outside too.

The norms are computed once per adapter, on the loader's thread, expanded as ‖W‖² + 2·scale·⟨W, B·A⟩ + scale²·‖B·A‖²
per row: ‖W‖² is the base layer's, read once per linear and kept; the cross term is A through the base weight (r rows,
a quantized base's dequantized weight as its forward uses it). Each sum runs over this rank's input columns, so a
row-parallel shard holds only its columns' part of each sum of squares. `reduce_norms` completes those with
one all-reduce per adapter, at its first slot load, on the main loop, where every rank runs the same slot loads in
the same order. The pool keeps per layer per fused linear a table of each slot's row scales (DoraTable: 1 for a plain
adapter, an untargeted slice and the base rows), made when a DoRA adapter first reaches that linear; LoRALinear
multiplies its output by the batch's rows of it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from loraplex.protocol.adapters.adapter_config import AdapterLoadError
from loraplex.worker.parallel import all_reduce
from torch import nn

# PEFT's saved name: ...layers.0.self_attn.q_proj.lora_magnitude_vector (older PEFT: with .weight or the adapter's name)
MAGNITUDE_KEY = re.compile(r"\.lora_magnitude_vector(?:\.\w+)*$")
_IDENTITY_ROWS = 256  # input columns read per pass of the base layer


def is_magnitude_key(key: str) -> bool:
    return MAGNITUDE_KEY.search(key) is not None


def lora_key_of(magnitude_key: str, which: str) -> str:
    """The name of the module's lora_A / lora_B weight beside its magnitude's, so the LoRA keys' parsing and TP rules
    apply to it."""
    return MAGNITUDE_KEY.sub(f".lora_{which}.weight", magnitude_key)


@dataclass
class DoraNorms:
    """An adapter's magnitudes and the squared norms of its updated weight's rows, this rank's part, by (layer, HF
    module); complete once `is_reduced` (every input column summed, on every rank)."""

    magnitudes: dict[tuple[int, str], torch.Tensor]  # (out of this rank,) in the model dtype
    norms_sq: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)  # (out of this rank,) float32
    row_parallel: frozenset[tuple[int, str]] = frozenset()  # modules whose sums hold only this rank's columns
    is_reduced: bool = False

    def row_scales(self, key: tuple[int, str], dtype: torch.dtype) -> torch.Tensor:
        """(out of this rank,) m / ‖W + scale·B·A‖ in `dtype`."""
        norm = self.norms_sq[key].sqrt().to(dtype)  # PEFT takes the norm in the weight's dtype
        return self.magnitudes[key].to(norm.device, dtype) / norm


@torch.no_grad()
def weight_norm_sq(linear: nn.Module, rows: slice, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                   base_sq: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """(rows,) float32: Σ over this rank's input columns of (W + scale·B·A)², W the base `linear`'s rows `rows` of
    this rank (before its all-reduce and bias), A (r, in of this rank) and B (rows, r) an adapter's, base_sq (rows,)
    the rows' Σ W² (base_rows_sq). Expanded as ‖W‖² + 2·scale·Σ_k B[:, k]·(A·Wᵀ)[k] + scale²·‖B·A‖², so an adapter
    costs one product of its A with the weight (r rows through the layer) and no (rows, in) tensor."""
    device = base_sq.device
    lora_a = lora_a.to(device, torch.float32)  # (r, in)
    lora_b = lora_b.to(device, torch.float32)  # (rows, r)
    a_w = weight_products(linear, lora_a, rows)  # (r, rows) = A·Wᵀ
    cross = (lora_b * a_w.mT).sum(dim=1)  # (rows,) = Σ_in W·(B·A)
    update_sq = ((lora_b @ (lora_a @ lora_a.mT)) * lora_b).sum(dim=1)  # (rows,) = Σ_in (B·A)²
    return (base_sq + 2 * scale * cross + scale * scale * update_sq).clamp_(min=0)


@torch.no_grad()
def base_rows_sq(linear: nn.Module) -> torch.Tensor:
    """(out of this rank,) float32: Σ over this rank's input columns of W², each output row; the part of every DoRA
    adapter's norms that no adapter changes (the manager keeps it per linear). A plain weight is read as it is; a
    packed or quantized one through the layer on identity columns, once."""
    weight = _plain_weight(linear)
    if weight is not None:
        return torch.linalg.vector_norm(weight, dim=1, dtype=torch.float32).square()  # no float32 copy of W
    num_cols = linear.input_size_per_rank
    device = _weight_param(linear).device
    all_rows = slice(0, sum(linear.output_sizes_per_rank))
    sums = torch.zeros(all_rows.stop, dtype=torch.float32, device=device)
    for start in range(0, num_cols, _IDENTITY_ROWS):
        stop = min(start + _IDENTITY_ROWS, num_cols)
        identity = torch.zeros(stop - start, num_cols, dtype=torch.float32, device=device)
        identity[torch.arange(stop - start), torch.arange(start, stop)] = 1.0
        sums += weight_products(linear, identity, all_rows).square().sum(dim=0)  # W[:, start:stop]ᵀ squared
    return sums


def weight_products(linear: nn.Module, x: torch.Tensor, rows: slice) -> torch.Tensor:
    """(n, rows) float32 = x·W[rows]ᵀ, x (n, in of this rank) float32, without the layer's bias or all-reduce. A
    plain weight in float32; a packed or quantized one through the layer's own `partial` in its dtype (a quantized
    base: its dequantized weight, as its forward uses it), less its output on a zero row (the bias, if any)."""
    weight = _plain_weight(linear)
    if weight is not None:
        return x @ weight[rows].float().mT
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])]).to(_weight_param(linear).dtype)  # (n + 1, in)
    y = linear.partial(padded)[:, rows].float()  # (n + 1, rows)
    return y[:-1] - y[-1:]


def _plain_weight(linear: nn.Module) -> torch.Tensor | None:
    """The layer's (out, in) weight where it holds one (not quantized, not packed away: worker/layers/packed.py)."""
    weight = getattr(linear, "weight", None)
    if getattr(linear, "quant", None) is not None or weight is None or weight.numel() == 0:
        return None
    return weight


def _weight_param(linear: nn.Module) -> torch.Tensor:
    """Any tensor of the layer's, for its device and activation dtype."""
    quant = getattr(linear, "quant", None)
    if quant is not None:
        return torch.empty(0, device=quant.device, dtype=quant.dtype)
    return linear.weight


def reduce_norms(norms: DoraNorms, tp_size: int, device: torch.device) -> None:
    """Sum the row-parallel modules' squares over the ranks (one all-reduce); every rank calls it for the same
    adapter at the same point (its first slot load)."""
    if norms.is_reduced:
        return
    keys = sorted(norms.row_parallel)
    if keys and tp_size > 1:
        flat = torch.cat([norms.norms_sq[key].to(device) for key in keys])
        all_reduce(flat, tp_size)
        for key, part in zip(keys, flat.split([norms.norms_sq[key].numel() for key in keys]), strict=True):
            norms.norms_sq[key] = part.to(norms.norms_sq[key].device)
    norms.is_reduced = True


@dataclass
class DoraTable:
    """One fused linear's row scales per slot in one layer: (slots + 1, out_per_rank), the last row for base rows;
    None until a DoRA adapter first fills a slot of it."""

    num_slots: int
    num_cols: int
    dtype: torch.dtype
    device: torch.device
    scales: torch.Tensor | None = None

    def write(self, slot: int, cols: slice, row_scales: torch.Tensor) -> None:
        if self.scales is None:
            with torch.inference_mode(False):  # a plain tensor, as the pool's: written outside inference mode too
                self.scales = torch.ones(self.num_slots + 1, self.num_cols, dtype=self.dtype, device=self.device)
        self.scales[slot, cols].copy_(row_scales, non_blocking=True)

    def clear(self, slot: int) -> None:
        if self.scales is not None:
            self.scales[slot].fill_(1.0)

    @property
    def num_bytes(self) -> int:
        return 0 if self.scales is None else self.scales.nbytes

    def apply(self, y: torch.Tensor, token_rows: torch.Tensor) -> None:
        """y (tokens, out_per_rank) *= each token's slot's row scales; `token_rows` (tokens,): slot, or num_slots."""
        if self.scales is not None:
            y.mul_(self.scales[token_rows])


def check_dora_targets(target_modules: tuple[str, ...], unsupported: tuple[str, ...]) -> None:
    bad = [m for m in target_modules if m in unsupported]
    if bad:
        raise AdapterLoadError(f"DoRA (use_dora: true) on {', '.join(bad)} is not supported")
