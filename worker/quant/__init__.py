"""Quantized checkpoints (docs/QUANTIZATION.md): formats.py reads each method's tensors into weights.py's two forms,
layer.py stages and shards them per linear, matmul.py picks the kernel once at load; coverage.py checks the model
reads quantized exactly the modules the checkpoint quantizes."""

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
