"""Checkpoint formats: which tensors one quantized linear stores, and how they decode into weights.py's forms.

A format object is built once from config.json's `quantization_config`; `tensor_names` are the suffixes each
linear's checkpoint entries carry (`...q_proj.qweight`), `decode` turns one projection's full tensors into an
(out, in) IntWeight or FloatWeight, and `encode` is its inverse. `random_tensors` draws one projection's tensors in
the format's own layout for --load-format dummy. GPTQ and AWQ are read per their documented packing (packing.py);
compressed-tensors through its own library."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from loraplex.worker.quant.mxfp4 import Mxfp4Format
from loraplex.worker.quant.packing import AWQ_ORDER, pack_int32, unpack_int32
from loraplex.worker.quant.weights import FloatWeight, IntWeight, QuantWeight


class QuantFormatError(ValueError):
    pass


class QuantFormat(Protocol):
    method: str  # --quantization's name
    description: str  # the method and how its weights are stored, for messages ("fp8 in 128x128 blocks")
    tensor_names: tuple[str, ...]
    experts_only: bool  # the checkpoint quantizes MoE experts alone (mxfp4.py); the decoder's linears are plain

    def quantizes(self, module_name: str) -> bool:
        """Whether the checkpoint stores the linear `module_name` (its own name, `model.layers.0.mlp.up_proj`)
        quantized rather than in full precision."""
        ...

    def decode(self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int) -> QuantWeight: ...

    def encode(self, weight: QuantWeight) -> dict[str, torch.Tensor]:
        """The checkpoint tensors that decode into `weight` (all of tensor_names but input_scale)."""
        ...

    def random_weight(self, out_features: int, in_features: int, std: float,
                      generator: torch.Generator) -> QuantWeight:
        """A weight of this format's shape of groups or blocks whose dequantized values are ~ N(0, std)."""
        ...


def random_tensors(fmt: QuantFormat, out_features: int, in_features: int, std: float,
                   generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One projection's full checkpoint tensors, drawn for --load-format dummy in the format's own layout."""
    tensors = fmt.encode(fmt.random_weight(out_features, in_features, std, generator))
    if "input_scale" in fmt.tensor_names:  # static activation scales: read and unused (activations stay unquantized)
        tensors["input_scale"] = torch.ones(1)
    return tensors


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected}")


class GPTQFormat:
    """AutoGPTQ's layout: qweight (in / pack, out) packed along the input, qzeros (groups, out / pack) packed along
    the output and stored minus one (checkpoint_format gptq; gptq_v2 stores them as is), scales (groups, out), g_idx
    (in,) each input column's group (a permutation of the groups under desc_act)."""

    method = "gptq"
    experts_only = False
    tensor_names = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, config: dict[str, Any]):
        self.bits = int(config.get("bits", 4))
        if self.bits not in (4, 8):
            raise QuantFormatError(f"GPTQ with {self.bits} bits is not supported (4 or 8)")
        self.group_size = int(config.get("group_size", 128))
        self.desc_act = bool(config.get("desc_act", False))
        self.zero_offset = 0 if config.get("checkpoint_format", "gptq") == "gptq_v2" else 1
        if config.get("lm_head", False):
            raise QuantFormatError("GPTQ with a quantized lm_head is not supported")
        if config.get("dynamic"):
            raise QuantFormatError("GPTQ with per-module overrides (dynamic) is not supported")
        self.description = f"gptq {self.bits}-bit" + (" with act-order (desc_act)" if self.desc_act else "")

    def quantizes(self, module_name: str) -> bool:
        return True  # every linear of the decoder

    def decode(self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int) -> IntWeight:
        group_size = in_features if self.group_size == -1 else self.group_size
        num_groups = -(-in_features // group_size)
        pack = 32 // self.bits
        _check_shape("qweight", tensors["qweight"], (in_features // pack, out_features))
        _check_shape("qzeros", tensors["qzeros"], (num_groups, out_features // pack))
        _check_shape("scales", tensors["scales"], (num_groups, out_features))
        _check_shape("g_idx", tensors["g_idx"], (in_features,))
        q = unpack_int32(tensors["qweight"], self.bits, dim=0).t().contiguous()  # (out, in)
        zeros = unpack_int32(tensors["qzeros"], self.bits, dim=1).t().to(torch.int32) + self.zero_offset
        g_idx = tensors["g_idx"].to(torch.int64)
        contiguous = torch.equal(g_idx, torch.arange(in_features) // group_size)
        return IntWeight(q=q, scales=tensors["scales"].t().float().contiguous(), zeros=zeros.contiguous(),
                         g_idx=None if contiguous else g_idx, group_size=group_size, bits=self.bits)

    def encode(self, weight: IntWeight) -> dict[str, torch.Tensor]:
        return {
            "qweight": pack_int32(weight.q.t(), self.bits, dim=0),  # (in / pack, out)
            "qzeros": pack_int32((weight.zeros - self.zero_offset).t(), self.bits, dim=1),  # (groups, out / pack)
            "scales": weight.scales.t().half().contiguous(),  # (groups, out)
            "g_idx": weight.group_index().to(torch.int32),  # (in,)
        }

    def random_weight(self, out_features: int, in_features: int, std: float,
                      generator: torch.Generator) -> IntWeight:
        # Symmetric, as AutoGPTQ writes it: unsigned around 2**(bits-1). Act order (desc_act) draws groups in column
        # order, a g_idx a desc_act checkpoint may hold.
        group_size = in_features if self.group_size == -1 else self.group_size
        return IntWeight.random(out_features, in_features, bits=self.bits, group_size=group_size,
                                zero_point=1 << (self.bits - 1), std=std, generator=generator)


class AWQFormat:
    """AutoAWQ's GEMM layout: qweight (in, out / 8) and qzeros (groups, out / 8) packed along the output in the
    interleaved order AWQ_ORDER, scales (groups, out); w = (q - zero) · scale."""

    method = "awq"
    experts_only = False
    tensor_names = ("qweight", "qzeros", "scales")

    def __init__(self, config: dict[str, Any]):
        self.bits = int(config.get("bits", config.get("w_bit", 4)))
        version = str(config.get("version", "gemm")).lower()
        if self.bits != 4 or version != "gemm":
            raise QuantFormatError(f"AWQ {self.bits}-bit {version} is not supported (4-bit gemm)")
        if not config.get("zero_point", True):
            raise QuantFormatError("AWQ without zero points is not supported")
        self.group_size = int(config.get("group_size", config.get("q_group_size", 128)))
        self.description = f"awq {self.bits}-bit {version}"

    def quantizes(self, module_name: str) -> bool:
        return True  # every linear of the decoder

    def decode(self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int) -> IntWeight:
        group_size = in_features if self.group_size == -1 else self.group_size
        num_groups = -(-in_features // group_size)
        _check_shape("qweight", tensors["qweight"], (in_features, out_features // 8))
        _check_shape("qzeros", tensors["qzeros"], (num_groups, out_features // 8))
        _check_shape("scales", tensors["scales"], (num_groups, out_features))
        q = unpack_int32(tensors["qweight"], 4, dim=1, order=AWQ_ORDER).t().contiguous()  # (out, in)
        zeros = unpack_int32(tensors["qzeros"], 4, dim=1, order=AWQ_ORDER).t().to(torch.int32).contiguous()
        return IntWeight(q=q, scales=tensors["scales"].t().float().contiguous(), zeros=zeros, g_idx=None,
                         group_size=group_size, bits=4)

    def encode(self, weight: IntWeight) -> dict[str, torch.Tensor]:
        return {
            "qweight": pack_int32(weight.q.t(), 4, dim=1, order=AWQ_ORDER),  # (in, out / 8)
            "qzeros": pack_int32(weight.zeros.t(), 4, dim=1, order=AWQ_ORDER),  # (groups, out / 8)
            "scales": weight.scales.t().half().contiguous(),  # (groups, out)
        }

    def random_weight(self, out_features: int, in_features: int, std: float,
                      generator: torch.Generator) -> IntWeight:
        group_size = in_features if self.group_size == -1 else self.group_size
        return IntWeight.random(out_features, in_features, bits=4, group_size=group_size, zero_point=8, std=std,
                                generator=generator)


class FP8Format:
    """vLLM's and transformers' `fp8` checkpoints: an FP8 `weight` with `weight_scale_inv` per
    weight_block_size block (DeepSeek's layout), or `weight_scale` per tensor. Activations are FP8 too (W8A8):
    `input_scale` with static activations is read and unused (scaled_mm.py scales each call's own)."""

    method = "fp8"
    experts_only = False

    def __init__(self, config: dict[str, Any]):
        self.block = tuple(config["weight_block_size"]) if config.get("weight_block_size") else None
        if self.block is not None and len(self.block) != 2:
            raise QuantFormatError(f"fp8 weight_block_size {list(self.block)} is not two sizes")
        scale = "weight_scale_inv" if self.block is not None else "weight_scale"
        static = config.get("activation_scheme", "dynamic") == "static"
        self.tensor_names = ("weight", scale, *(("input_scale",) if static else ()))
        self.description = "fp8 " + ("per tensor" if self.block is None else "in {}x{} blocks".format(*self.block))

    def quantizes(self, module_name: str) -> bool:
        return True  # every linear of the decoder

    def decode(self, tensors: dict[str, torch.Tensor], out_features: int, in_features: int) -> FloatWeight:
        weight = tensors["weight"]
        _check_shape("weight", weight, (out_features, in_features))
        if self.block is None:
            scale = tensors["weight_scale"].float().reshape(-1)
            if scale.numel() != 1:
                raise ValueError(f"weight_scale has {scale.numel()} values, expected one per tensor")
            return FloatWeight.blocked(weight, scale.reshape(1, 1), out_features, in_features, w8a8=True)
        rows, cols = self.block
        scales = tensors["weight_scale_inv"].float()
        _check_shape("weight_scale_inv", scales, (-(-out_features // rows), -(-in_features // cols)))
        return FloatWeight.blocked(weight, scales, rows, cols, w8a8=True)

    def encode(self, weight: FloatWeight) -> dict[str, torch.Tensor]:
        if self.block is None:
            return {"weight": weight.q, "weight_scale": weight.scales.reshape(())}  # one scale per tensor
        return {"weight": weight.q, "weight_scale_inv": weight.scales}  # (row blocks, column blocks) float32

    def random_weight(self, out_features: int, in_features: int, std: float,
                      generator: torch.Generator) -> FloatWeight:
        rows, cols = self.block or (out_features, in_features)
        return FloatWeight.random(out_features, in_features, block_rows=rows, block_cols=cols, std=std,
                                  generator=generator)


def build_format(method: str, config: dict[str, Any]) -> QuantFormat:
    """The format of a checkpoint whose quantization_config is `config` (method already resolved)."""
    if method == "gptq":
        return GPTQFormat(config)
    if method == "awq":
        return AWQFormat(config)
    if method == "fp8":
        return FP8Format(config)
    if method == "mxfp4":
        return Mxfp4Format(config)
    # Only here: the library imports transformers, seconds of start-up a plain checkpoint need not pay.
    from loraplex.worker.quant.compressed_tensors import CompressedTensorsFormat

    return CompressedTensorsFormat(config)
