"""compressed-tensors checkpoints (llm-compressor's output) read through the library's own config classes and
unpacking: pack-quantized INT4/INT8 weights (W4A16, W8A16) per channel or per group (with act-order g_idx),
int-quantized INT8 and float-quantized FP8 per tensor, per channel or per block; weight-only or with quantized
activations (W8A8): INT8 W8A8 runs weight-only, FP8 W8A8 is marked for torch._scaled_mm (scaled_mm.py)."""

from __future__ import annotations

import re
from typing import Any

import torch
from compressed_tensors import QuantizationConfig
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationScheme
from loraplex.worker.quant.formats import PLAIN_MODULES, QuantFormatError
from loraplex.worker.quant.weights import FloatWeight, IntWeight, QuantWeight

_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
_STRATEGIES = ("tensor", "channel", "group", "block")


class CompressedTensorsFormat:
    method = "compressed-tensors"

    def __init__(self, config: dict[str, Any]):
        try:
            parsed = QuantizationConfig.model_validate(config)
        except ValueError as e:
            raise QuantFormatError(f"compressed-tensors quantization_config: {e}") from e
        schemes = list(parsed.config_groups.values())
        if len(schemes) != 1 or schemes[0].targets != ["Linear"]:
            raise QuantFormatError("compressed-tensors: only one config group targeting every Linear is supported")
        for name in parsed.ignore or []:
            pattern = name.removeprefix("re:")
            if not any(re.fullmatch(pattern, plain) or plain == name for plain in PLAIN_MODULES):
                raise QuantFormatError(f"compressed-tensors: ignoring {name!r} (a decoder linear left in full "
                                       "precision) is not supported")
        self.scheme: QuantizationScheme = schemes[0]
        self.format = str(self.scheme.format or parsed.format)
        weights = self.scheme.weights
        if self.format not in _FORMATS or weights is None or weights.strategy not in _STRATEGIES:
            raise QuantFormatError(f"compressed-tensors format {self.format} with weight strategy "
                                   f"{None if weights is None else weights.strategy} is not supported")
        supported_bits = (8,) if weights.type == "float" else (4, 8)
        if weights.num_bits not in supported_bits:
            raise QuantFormatError(f"compressed-tensors {weights.type}{weights.num_bits} weights are not supported")
        self.weights = weights
        names = BaseCompressor.load_from_registry(self.format).compression_param_names(self.scheme)
        inputs = self.scheme.input_activations
        static_inputs = inputs is not None and not inputs.dynamic
        self.w8a8 = inputs is not None and inputs.type == "float" and inputs.num_bits == 8 and weights.type == "float"
        has_g_idx = weights.actorder is not None and weights.strategy == "group"
        self.tensor_names = (*names, *(("input_scale",) if static_inputs else ()),
                             *(("weight_g_idx",) if has_g_idx else ()))

    def decode(self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int) -> QuantWeight:
        args = self.weights
        scale = tensors["weight_scale"].float()
        if args.type == "float":
            q = tensors["weight"]
            if args.strategy == "block":
                return FloatWeight.blocked(q, scale, *args.block_structure, w8a8=self.w8a8)
            rows = out_features if args.strategy == "tensor" else 1
            return FloatWeight.blocked(q, scale.reshape(-1, 1), rows, in_features, w8a8=self.w8a8)
        if self.format == "pack-quantized":
            shape = torch.Size((out_features, in_features))
            q = unpack_from_int32(tensors["weight_packed"], args.num_bits, shape)
        else:
            q = tensors["weight"]
        if tuple(q.shape) != (out_features, in_features):
            raise ValueError(f"weight has shape {tuple(q.shape)}, expected {(out_features, in_features)}")
        scales = scale.reshape(out_features, -1) if scale.numel() > 1 else scale.reshape(1, 1).expand(out_features, 1)
        zeros = tensors.get("weight_zero_point")
        if zeros is not None:
            if self.format == "pack-quantized":
                zeros = unpack_from_int32(zeros, args.num_bits, torch.Size(scales.shape), packed_dim=0)
            zeros = zeros.reshape(scales.shape).to(torch.int32).contiguous()
        group_size = args.group_size if args.strategy == "group" else in_features
        g_idx = tensors.get("weight_g_idx")
        if g_idx is not None:
            g_idx = g_idx.to(torch.int64)
            if torch.equal(g_idx, torch.arange(in_features) // group_size):
                g_idx = None
        return IntWeight(q=q.to(torch.int8).contiguous(), scales=scales.contiguous().clone(), zeros=zeros,
                         g_idx=g_idx, group_size=group_size, bits=args.num_bits)

    def encode(self, weight: QuantWeight) -> dict[str, torch.Tensor]:
        """Through the library's own compressor: the dequantized weight with its scales (and zero points) as an
        observer would have left them, compressed as llm-compressor saves it (bfloat16 scales)."""
        per_tensor = self.weights.strategy == "tensor"  # one value, shaped (1,) as calculate_qparams makes it

        def stored(t: torch.Tensor) -> torch.Tensor:
            return t[:1, :1].reshape(1) if per_tensor else t

        state = {"weight": weight.dequantize(slice(None), torch.float32),
                 "weight_scale": stored(weight.scales).bfloat16()}
        if isinstance(weight, IntWeight) and weight.zeros is not None:
            state["weight_zero_point"] = stored(weight.zeros).to(torch.int8)
        tensors = BaseCompressor.load_from_registry(self.format).compress(state, self.scheme)
        if "weight_g_idx" in self.tensor_names:
            tensors["weight_g_idx"] = weight.group_index().to(torch.int32)
        return {name: tensors[name] for name in self.tensor_names if name in tensors}

    def random_weight(self, out_features: int, in_features: int, std: float,
                      generator: torch.Generator) -> QuantWeight:
        args = self.weights
        if args.type == "float":
            rows, cols = {"tensor": (out_features, in_features), "channel": (1, in_features)}.get(
                args.strategy, args.block_structure)
            return FloatWeight.random(out_features, in_features, block_rows=rows, block_cols=cols, std=std,
                                      generator=generator)
        group_size = args.group_size if args.strategy == "group" else in_features
        return IntWeight.random(out_features, in_features, bits=args.num_bits, group_size=group_size,
                                zero_point=None if args.symmetric else 0, std=std, generator=generator)
