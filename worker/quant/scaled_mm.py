"""W8A8 FP8 through torch._scaled_mm (cuBLAS/CUTLASS FP8 tensor cores, compute capability 8.9 and up): a checkpoint
that quantizes activations too (fp8, compressed-tensors FP8 with input_activations) with one weight scale per output
row or per tensor has each call's activations quantized to float8_e4m3fn on the fly:

  per-channel weight scales  ->  one activation scale per token   (row-wise scaling: scale_a (M, 1), scale_b (1, N))
  per-tensor weight scale    ->  one activation scale per call    (tensor-wise scaling: two scalars)

Activation scales are the current amax / 448, also for checkpoints with a static `input_scale`: at least as fine as
the calibrated one. _scaled_mm's layout rules on CUDA: the first operand row-major, the second column-major (the
(out, in) weight's transpose), every operand dimension but the token count a multiple of 16, float32 scales; row-wise
scaling writes bfloat16 only (an fp16 model's output is cast back)."""

from __future__ import annotations

import torch
from loraplex.worker.quant.weights import FloatWeight, QuantWeight

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
MIN_SCALE = 1.0 / (FP8_MAX * 512)  # an all-zero token still gets a positive scale (its values stay 0)
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper and later
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)  # float32 models keep the weight-only path (exact to HF)


def row_scales(weight: FloatWeight) -> torch.Tensor | None:
    """(out,) each output row's one scale, or None where a row's scale changes along the input (blocks)."""
    col_ids = weight.col_ids
    if col_ids.numel() == 0 or not bool((col_ids == col_ids[0]).all()):
        return None
    return weight.scales[weight.row_ids, col_ids[0]].float()


def quantize_activations(x: torch.Tensor, per_token: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q (tokens, in) float8_e4m3fn row-major, its float32 scale: (tokens, 1) per token or () per tensor), with
    x ≈ x_q · scale."""
    amax = x.abs().amax(dim=-1, keepdim=True) if per_token else x.abs().amax()
    scale = (amax.float() / FP8_MAX).clamp_min(MIN_SCALE)
    x_q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return x_q.contiguous(), scale


class ScaledMMFP8Matmul:
    name = "fp8 W8A8 (torch._scaled_mm)"

    @staticmethod
    def fits(weight: QuantWeight, device: torch.device, dtype: torch.dtype) -> bool:
        if device.type != "cuda" or not isinstance(weight, FloatWeight) or not weight.w8a8:
            return False
        num_rows, num_cols = weight.shape
        if dtype not in ACTIVATION_DTYPES or num_rows % 16 or num_cols % 16:
            return False
        return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY and row_scales(weight) is not None

    def __init__(self, weight: FloatWeight, dtype: torch.dtype):
        scales = row_scales(weight)  # (out,)
        self.q = weight.q.contiguous()  # (out, in): its transpose is the column-major (in, out) operand
        self.per_tensor = bool((scales == scales[0]).all())
        # () for tensor-wise scaling, (1, out) for row-wise
        self.weight_scale = scales[0].clone() if self.per_tensor else scales.reshape(1, -1).contiguous()
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.q, self.weight_scale))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(0, self.q.shape[0])
        x_q, x_scale = quantize_activations(x, per_token=not self.per_tensor)
        out_dtype = x.dtype if self.per_tensor else torch.bfloat16
        y = torch._scaled_mm(x_q, self.q.t(), scale_a=x_scale, scale_b=self.weight_scale, out_dtype=out_dtype)
        return y.to(x.dtype)  # (tokens, out)
