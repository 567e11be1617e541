"""Quantized checkpoints (docs/QUANTIZATION.md): formats.py reads each method's tensors into weights.py's two forms,
layer.py stages and shards them per linear, matmul.py picks the kernel once at load; coverage.py checks the model
reads quantized exactly the modules the checkpoint quantizes.

formats.py             checkpoint formats: which tensors one quantized linear stores, how they decode
compressed_tensors.py  compressed-tensors checkpoints, through the library's own config classes
packing.py             sub-byte integers packed into int32 words (GPTQ, AWQ)
weights.py             the two forms every format decodes into: integer weights with scales, FP8 weights
layer.py               QuantizedLinearWeights: one TP linear's quantized weight, checkpoint tensors to kernel
matmul.py              x · Wᵀ for one quantized weight, the kernel chosen once at load
avx2.py                INT8/INT4 weights repacked at load for the AVX2 skinny-matrix decode kernel
scaled_mm.py           W8A8 FP8 through torch._scaled_mm
coverage.py            the modules the checkpoint quantizes against those the model reads quantized
mxfp4.py               MXFP4 experts (gpt-oss): the format, E2M1 codes and E8M0 scales dequantized per expert
"""

from __future__ import annotations

from loraplex.protocol.quantization import read_hf_config, resolve_quantization
from loraplex.worker.quant.coverage import check_coverage
from loraplex.worker.quant.formats import QuantFormat, QuantFormatError, build_format
from loraplex.worker.quant.layer import quantized_linears


def checkpoint_format(flag: str, model_dir: str) -> QuantFormat | None:
    """The format the checkpoint's linears are read in (None: plain weights); ConfigError or QuantFormatError
    names what cannot be served."""
    hf_config = read_hf_config(model_dir)
    method = resolve_quantization(flag, hf_config)
    return None if method is None else build_format(method, hf_config["quantization_config"])


__all__ = ["QuantFormat", "QuantFormatError", "check_coverage", "checkpoint_format", "quantized_linears"]
