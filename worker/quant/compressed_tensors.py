"""compressed-tensors checkpoints (llm-compressor's output) read through the library's own config classes and
unpacking: pack-quantized INT4/INT8 weights (W4A16, W8A16) per channel or per group (actorder "weight"/"static" as
plain groups; "group" with each linear's weight_g_idx), int-quantized INT8 and float-quantized FP8 per tensor, per
channel or per block; weight-only or with quantized activations (W8A8): INT8 W8A8 runs weight-only, FP8 W8A8 is marked
for torch._scaled_mm (scaled_mm.py). `ignore` may name any module the decoder's linears are not (coverage.py)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from compressed_tensors import QuantizationConfig
from compressed_tensors.compressors.base import BaseCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.utils import match_name
from loraplex.worker.quant.formats import QuantFormatError
from loraplex.worker.quant.weights import FloatWeight, IntWeight, QuantWeight

_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
_STRATEGIES = ("tensor", "channel", "group", "block")


# actorder values under which every linear stores `weight_g_idx`, each input column's group (GPTQ's desc_act):
# "group" (alias "dynamic"; `true` in older configs). The installed library has removed this ordering and refuses
# configs that name it, so it is read here and taken out before the library parses the rest. "weight" (alias
# "static") reorders the columns only while quantizing: groups stay contiguous and no g_idx is stored.
_GROUP_ORDERS = ("group", "dynamic", True)


class CompressedTensorsFormat:
    method = "compressed-tensors"
    experts_only = False

    def __init__(self, config: dict[str, Any]):
        config, self.group_order = _without_group_order(config)
        try:
            parsed = QuantizationConfig.model_validate(config)
        except ValueError as e:
            raise QuantFormatError(f"compressed-tensors quantization_config: {e}") from e
        schemes = list(parsed.config_groups.values())
        if len(schemes) != 1 or schemes[0].targets != ["Linear"]:
            raise QuantFormatError("compressed-tensors: only one config group targeting every Linear is supported")
        self.ignore = tuple(parsed.ignore or ())  # modules left in full precision (checked against the model's)
        self.scheme: QuantizationScheme = schemes[0]
        self.format = str(self.scheme.format or parsed.format)
        weights = self.scheme.weights
        if self.format not in _FORMATS or weights is None or weights.strategy not in _STRATEGIES:
            raise QuantFormatError(f"compressed-tensors format {self.format} with weight strategy "
                                   f"{None if weights is None else weights.strategy} is not supported")
        supported_bits = (8,) if weights.type == "float" else (4, 8)
        if weights.num_bits not in supported_bits:
            raise QuantFormatError(f"compressed-tensors {weights.type}{weights.num_bits} weights are not supported")
        if self.group_order and weights.strategy != "group":
            raise QuantFormatError(f"compressed-tensors actorder 'group' with weight strategy {weights.strategy} "
                                   "(it orders groups)")
        self.weights = weights
        per = str(weights.strategy)
        if per == "group":
            per = f"group of {weights.group_size}"
        elif per == "block":
            per = "{}x{} block".format(*weights.block_structure)
        self.description = f"compressed-tensors {self.format} {weights.type}{weights.num_bits} per {per}"
        names = BaseCompressor.load_from_registry(self.format).compression_param_names(self.scheme)
        inputs = self.scheme.input_activations
        static_inputs = inputs is not None and not inputs.dynamic
        self.w8a8 = inputs is not None and inputs.type == "float" and inputs.num_bits == 8 and weights.type == "float"
        self.tensor_names = (*names, *(("input_scale",) if static_inputs else ()),
                             *(("weight_g_idx",) if self.group_order else ()))

    def quantizes(self, module_name: str) -> bool:
        return not any(match_name(module_name, name) for name in self.ignore)  # the library's rule: exact or re:

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
        if isinstance(weight, IntWeight) and weight.g_idx is not None:
            tensors = _pack_scattered_groups(weight, state, self.weights.num_bits)
        else:
            tensors = BaseCompressor.load_from_registry(self.format).compress(state, self.scheme)
        if self.group_order:
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


def _without_group_order(config: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """(config with every weights' actorder in _GROUP_ORDERS taken out, whether there was one)."""
    config = copy.deepcopy(config)
    found = False
    for group in (config.get("config_groups") or {}).values():
        weights = group.get("weights") if isinstance(group, dict) else None
        order = weights.get("actorder") if isinstance(weights, dict) else None
        if (order.lower() if isinstance(order, str) else order) in _GROUP_ORDERS:
            weights["actorder"] = None
            found = True
    return config, found


def _pack_scattered_groups(weight: IntWeight, state: dict[str, torch.Tensor], bits: int) -> dict[str, torch.Tensor]:
    """pack-quantized tensors of a weight whose groups are scattered (g_idx): the library's compressor quantizes
    contiguous groups only, so the stored integers are packed with its packer directly."""
    tensors = {"weight_packed": pack_to_int32(weight.q.to(torch.int8), bits),  # (out, in * bits / 32)
               "weight_shape": torch.tensor(weight.shape), "weight_scale": state["weight_scale"]}
    if "weight_zero_point" in state:
        tensors["weight_zero_point"] = pack_to_int32(state["weight_zero_point"], bits, packed_dim=0)
    return tensors
