"""A quantized copy of a plain checkpoint, beside the plain checkpoint of the same weights dequantized (what HF
transformers and peft run as the reference in the tests; the benchmarks' bf16 side).

    python -m tests.quantize_checkpoint PLAIN_DIR FORMAT OUT_DIR [DEQUANTIZED_DIR] [--group-size N]

compressed-tensors checkpoints are written by the library's own compressors; GPTQ, AWQ and vLLM's fp8 in their
documented layouts (loraplex's packing helpers, whose bit orders tests/unit/test_quantization.py checks). Scales and
zero points come from each group's min/max (round to nearest), enough to exercise every format's reading."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from loraplex.worker.quant.packing import AWQ_ORDER, pack_int32
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max

# format name -> what it is; `write_quantized` builds each
FORMATS = {
    "gptq-4bit": "GPTQ 4-bit, groups, desc_act false",
    "gptq-4bit-act-order": "GPTQ 4-bit, groups, desc_act true (shuffled g_idx)",
    "gptq-8bit-act-order": "GPTQ 8-bit, groups, desc_act true",
    "awq-4bit": "AWQ 4-bit GEMM, groups, zero points",
    "ct-w4a16": "compressed-tensors pack-quantized INT4, symmetric groups",
    "ct-w4a16-asym": "compressed-tensors pack-quantized INT4, asymmetric groups",
    "ct-w4a16-actorder-weight": "compressed-tensors INT4 groups, actorder weight (groups contiguous, no g_idx)",
    "ct-w4a16-actorder-static": "compressed-tensors INT4 groups, actorder static (weight's alias)",
    "ct-w4a16-actorder-group": "compressed-tensors INT4 groups, actorder group (shuffled weight_g_idx)",
    "ct-w8a16": "compressed-tensors pack-quantized INT8, per channel",
    "ct-fp8-tensor": "compressed-tensors FP8 per tensor, W8A8 with static input scales",
    "ct-fp8-channel": "compressed-tensors FP8 per channel, W8A8 with dynamic per-token activations",
    "ct-fp8-block": "compressed-tensors FP8 128x128 blocks, weight-only",
    "fp8-block": "vLLM/transformers fp8 with weight_block_size 128x128 (weight_scale_inv)",
}


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and any(f".{m}." in name for m in LINEARS)


def write_quantized(plain_dir: Path, fmt: str, quant_dir: Path, dequant_dir: Path | None,
                    group_size: int = 32) -> None:
    """quant_dir: plain_dir's checkpoint with every decoder linear in `fmt` (groups of group_size input columns
    where the format has groups); dequant_dir (unless None): the same weights, plain."""
    state = load_file(str(plain_dir / "model.safetensors"))
    quantized, dequantized = {}, {}
    permutations: dict[int, torch.Tensor] = {}  # act order: one per input size (projections of one input share it)
    generator = torch.Generator().manual_seed(0)
    quant_config = None
    for name, tensor in state.items():
        if not _is_linear(name):
            quantized[name] = dequantized[name] = tensor
            continue
        prefix = name.removesuffix("weight")
        in_features = tensor.shape[1]
        perm = permutations.setdefault(in_features, torch.randperm(in_features, generator=generator))
        tensors, weight, quant_config = _quantize(fmt, tensor.float(), perm, group_size)
        quantized.update({prefix + k: v.contiguous() for k, v in tensors.items()})
        dequantized[name] = weight.to(tensor.dtype).contiguous()
    shutil.copytree(plain_dir, quant_dir, dirs_exist_ok=True)
    save_file(quantized, str(quant_dir / "model.safetensors"), metadata={"format": "pt"})
    if dequant_dir is not None:
        shutil.copytree(plain_dir, dequant_dir, dirs_exist_ok=True)
        save_file(dequantized, str(dequant_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((plain_dir / "config.json").read_text())
    config["quantization_config"] = quant_config
    (quant_dir / "config.json").write_text(json.dumps(config, indent=2))


def _quantize(fmt: str, w: torch.Tensor, perm: torch.Tensor,
              group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict]:
    """(checkpoint tensors of one linear, its dequantized weight, quantization_config)."""
    if fmt.startswith("gptq"):
        return _gptq(w, bits=8 if "8bit" in fmt else 4, group_size=group_size,
                     perm=perm if "act-order" in fmt else None)
    if fmt == "awq-4bit":
        return _awq(w, group_size=group_size)
    if fmt == "fp8-block":
        return _fp8_block(w)
    if fmt == "ct-w4a16-actorder-group":
        return _ct_group_order(w, perm, group_size)
    return _compressed_tensors(fmt, w, group_size)


def _int_groups(w: torch.Tensor, bits: int, g_idx: torch.Tensor, num_groups: int, sym: bool):
    """Unsigned q (out, in), fp16-exact scales (out, groups) and integer zeros (out, groups): w ≈ (q - z)·s."""
    maxq = 2**bits - 1
    cols = [w[:, g_idx == g] for g in range(num_groups)]
    lo = torch.stack([c.amin(1) for c in cols], 1).clamp(max=0)
    hi = torch.stack([c.amax(1) for c in cols], 1).clamp(min=0)
    if sym:
        scales = (torch.maximum(-lo, hi) / (maxq / 2)).half().float()
        zeros = torch.full_like(scales, (maxq + 1) // 2)
    else:
        scales = ((hi - lo) / maxq).half().float()
        zeros = torch.round(-lo / scales).clamp(1, maxq)  # >= 1: GPTQ v1 stores zero - 1 unsigned
    q = torch.clamp(torch.round(w / scales[:, g_idx]) + zeros[:, g_idx], 0, maxq)
    dequant = (q - zeros[:, g_idx]) * scales[:, g_idx]
    return q.to(torch.int64), scales, zeros.to(torch.int64), dequant


def _gptq(w: torch.Tensor, bits: int, group_size: int, perm: torch.Tensor | None):
    out_features, in_features = w.shape
    num_groups = in_features // group_size
    g_idx = torch.arange(in_features) // group_size
    if perm is not None:  # desc_act: columns quantized in the order perm, group k holds perm[k·size:(k+1)·size]
        g_idx = torch.empty_like(g_idx)
        g_idx[perm] = torch.arange(in_features) // group_size
    q, scales, zeros, dequant = _int_groups(w, bits, g_idx, num_groups, sym=True)
    tensors = {
        "qweight": pack_int32(q.t(), bits, dim=0),  # (in / pack, out)
        "qzeros": pack_int32((zeros - 1).t(), bits, dim=1),  # (groups, out / pack), stored minus one
        "scales": scales.t().half(),  # (groups, out)
        "g_idx": g_idx.to(torch.int32),
    }
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": perm is not None,
              "sym": True, "checkpoint_format": "gptq"}
    return tensors, dequant, config


def _awq(w: torch.Tensor, group_size: int):
    in_features = w.shape[1]
    g_idx = torch.arange(in_features) // group_size
    q, scales, zeros, dequant = _int_groups(w, 4, g_idx, in_features // group_size, sym=False)
    tensors = {
        "qweight": pack_int32(q.t(), 4, dim=1, order=AWQ_ORDER),  # (in, out / 8)
        "qzeros": pack_int32(zeros.t(), 4, dim=1, order=AWQ_ORDER),  # (groups, out / 8)
        "scales": scales.t().half(),  # (groups, out)
    }
    config = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return tensors, dequant, config


def _fp8_block(w: torch.Tensor, block: int = 128):
    out_features, in_features = w.shape
    rows, cols = -(-out_features // block), -(-in_features // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:out_features, :in_features] = w
    tiles = padded.view(rows, block, cols, block)
    scales = tiles.abs().amax((1, 3)).clamp(min=1e-12) / FP8_MAX  # (rows, cols)
    expanded = scales.repeat_interleave(block, 0)[:out_features].repeat_interleave(block, 1)[:, :in_features]
    q = (w / expanded).to(torch.float8_e4m3fn)
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    return {"weight": q, "weight_scale_inv": scales}, q.float() * expanded, config


def _compressed_tensors(fmt: str, w: torch.Tensor, group_size: int):
    from compressed_tensors import QuantizationConfig
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    inputs = None
    if fmt.startswith(("ct-w4a16", "ct-w8a16")):
        bits = 8 if fmt == "ct-w8a16" else 4
        group = dict(strategy="channel") if bits == 8 else dict(strategy="group", group_size=group_size)
        actorder = fmt.partition("-actorder-")[2] or None  # weight/static: calibration order only, nothing stored
        weights = QuantizationArgs(num_bits=bits, type="int", symmetric=not fmt.endswith("asym"), actorder=actorder,
                                   **group)
        compression = "pack-quantized"
    else:
        strategy = fmt.removeprefix("ct-fp8-")
        extra = dict(block_structure=[128, 128]) if strategy == "block" else {}
        weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy, **extra)
        if strategy == "tensor":
            inputs = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False)
        elif strategy == "channel":
            inputs = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True)
        compression = "float-quantized"
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    lo, hi = _ranges(w, weights)
    scale, zero_point = calculate_qparams(lo, hi, weights)
    state = {"weight": w, "weight_scale": scale}
    if not weights.symmetric:
        state["weight_zero_point"] = zero_point
    compressor = BaseCompressor.load_from_registry(compression)
    tensors = compressor.compress(state, scheme)
    if inputs is not None and not inputs.dynamic:
        tensors["input_scale"] = torch.tensor([0.05])
    dequant = compressor.decompress(tensors, scheme)["weight"]
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=compression,
                                quantization_status="compressed", ignore=["lm_head"]).model_dump(mode="json")
    return tensors, dequant, config


def _ct_group_order(w: torch.Tensor, perm: torch.Tensor, group_size: int):
    """compressed-tensors W4A16 with actorder "group", as llm-compressor wrote it before the library removed that
    ordering: group k holds the columns perm[k·size:(k+1)·size], weight_g_idx is each column's group. The library
    refuses such a config and no longer quantizes by g_idx, so the integers are packed with its packer and the
    config's actorder is written in after it is dumped."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    in_features = w.shape[1]
    g_idx = torch.empty(in_features, dtype=torch.int64)
    g_idx[perm] = torch.arange(in_features) // group_size
    q, scales, zeros, dequant = _int_groups(w, 4, g_idx, in_features // group_size, sym=True)
    tensors = {"weight_packed": pack_to_int32((q - zeros[:, g_idx]).to(torch.int8), 4),  # signed, (out, in / 8)
               "weight_scale": scales.half(), "weight_shape": torch.tensor(w.shape),
               "weight_g_idx": g_idx.to(torch.int32)}
    config = _compressed_tensors("ct-w4a16", w, group_size)[2]
    config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    return tensors, dequant, config


def _ranges(w: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-scale min and max of w (what an observer would measure) for the scheme's strategy."""
    out_features, in_features = w.shape
    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy == "group":
        groups = w.view(out_features, -1, args.group_size)
        return groups.amin(-1), groups.amax(-1)
    block = args.block_structure[0]
    rows, cols = -(-out_features // block), -(-in_features // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:out_features, :in_features] = w
    tiles = padded.view(rows, block, cols, block)
    return tiles.amin((1, 3)), tiles.amax((1, 3))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plain_dir", type=Path)
    parser.add_argument("format", choices=list(FORMATS), help="; ".join(f"{k}: {v}" for k, v in FORMATS.items()))
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("dequantized_dir", type=Path, nargs="?", help="also write the dequantized weights here")
    parser.add_argument("--group-size", type=int, default=32)
    args = parser.parse_args(argv)
    write_quantized(args.plain_dir, args.format, args.out_dir, args.dequantized_dir, args.group_size)


if __name__ == "__main__":
    main()
