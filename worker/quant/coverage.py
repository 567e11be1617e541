"""Which of the model's modules the checkpoint quantizes, against how the model reads them, checked once the model is
built and before any weight is read: every decoder linear is read in the checkpoint's format, so one the checkpoint
leaves in full precision (compressed-tensors' `ignore`) is refused. MoE experts are built to read the checkpoint's
format (worker/layers/expert_weights.py; under MXFP4 the experts alone are quantized, the linears plain): experts the
checkpoint leaves plain are switched to plain weights here, a layer whose experts are partly plain is refused. Modules
the checkpoint leaves plain that the model reads plain (the LM head, an MoE router, a vision tower it does not build)
are what they should be."""

from __future__ import annotations

from loraplex.worker.loader import checkpoint_module_names
from loraplex.worker.quant.formats import QuantFormat, QuantFormatError
from torch import nn


def check_coverage(fmt: QuantFormat, model: nn.Module) -> None:
    for name, module in model.named_modules():
        if getattr(module, "quant", None) is not None:  # a decoder linear read in fmt
            for piece in checkpoint_module_names(model, name):
                plain = next((hf_name for hf_name in piece if not fmt.quantizes(hf_name)), None)
                if plain is not None:
                    raise QuantFormatError(f"{fmt.description}: the checkpoint leaves {plain} in full precision "
                                           "(ignore); a decoder linear unquantized beside quantized ones is not "
                                           "supported")
        elif hasattr(module, "checkpoint_shards") and not fmt.experts_only:  # stacked MoE experts, built quantized
            # a piece is left plain when the checkpoint ignores it under any of its spellings
            plain = [not all(fmt.quantizes(hf_name) for hf_name in piece)
                     for piece in checkpoint_module_names(model, name)]  # fmt: skip
            if all(plain):
                module.read_plain()
            elif any(plain):
                raise QuantFormatError(f"{fmt.description}: the checkpoint leaves some of {name}'s experts in full "
                                       "precision (ignore) and quantizes others; that mix is not supported")
