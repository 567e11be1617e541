"""An MXFP4 copy of a plain gpt-oss checkpoint, as the published gpt-oss checkpoints store their experts (the experts'
`<proj>_blocks` and `<proj>_scales`, rows in (out, in) order; every other tensor plain), beside the plain checkpoint of
the same weights dequantized: the reference the quantized one must equal. Each block's scale is the smallest power of
two that brings its largest magnitude within E2M1's 6; values round to the nearest E2M1 code."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from loraplex.worker.quant.mxfp4 import BLOCK_SIZE, E2M1_VALUES, E8M0_BIAS, dequantize
from safetensors.torch import load_file, save_file

_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, in) float -> codes (rows, in / 32, 16) uint8 and scales (rows, in / 32) uint8."""
    num_rows, num_inputs = w.shape
    blocks = w.float().view(num_rows, num_inputs // BLOCK_SIZE, BLOCK_SIZE)
    amax = blocks.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponents = torch.ceil(torch.log2(amax / 6.0)).clamp(-E8M0_BIAS, 127)  # (rows, blocks)
    scaled = blocks / torch.exp2(exponents)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    index = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # nearest magnitude
    codes = (index | ((scaled < 0).long() << 3)).to(torch.uint8).view(num_rows, -1, BLOCK_SIZE // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)  # the even input in the low nibble
    return packed, (exponents + E8M0_BIAS).to(torch.uint8)


def write_mxfp4(plain_dir: Path, quant_dir: Path, dequant_dir: Path) -> None:
    """quant_dir: the experts MXFP4 (quantization_config mxfp4); dequant_dir: the same weights plain, float32."""
    tensors = load_file(str(plain_dir / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in tensors.items():
        if _EXPERTS.search(name) is None:
            quantized[name] = dequantized[name] = tensor
            continue
        rows = tensor.transpose(1, 2).contiguous()  # (experts, out, in): the plain checkpoint stacks (experts, in, out)
        codes, scales = zip(*(encode(expert) for expert in rows), strict=True)
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = torch.stack(codes), torch.stack(scales)
        values = [dequantize(c.flatten(1), s, torch.float32) for c, s in zip(codes, scales, strict=True)]
        dequantized[name] = torch.stack(values).transpose(1, 2).contiguous()
    config = json.loads((plain_dir / "config.json").read_text())
    for out_dir, out_tensors, extra in ((quant_dir, quantized, {"quantization_config": QUANTIZATION_CONFIG}),
                                        (dequant_dir, dequantized, {})):  # fmt: skip
        out_dir.mkdir(parents=True, exist_ok=True)
        for path in plain_dir.iterdir():  # tokenizer and generation config
            if path.suffix != ".safetensors" and path.name != "config.json":
                shutil.copy(path, out_dir / path.name)
        save_file({k: v.contiguous() for k, v in out_tensors.items()}, str(out_dir / "model.safetensors"))
        (out_dir / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
