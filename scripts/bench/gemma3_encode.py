"""Gemma 3's vision side per image (worker/model/gemma3_vision.py: the SigLIP tower and the pooling projector) at
gemma-3-4b-it's widths (hidden 1152, 16 heads, MLP 4304, 896x896 images of 14x14 patches: 4096 patches pooled to 256
soft tokens; random weights), with fewer of its 27 blocks unless told: milliseconds per image, scaled to 27 blocks.

    python -m scripts.bench.gemma3_encode [--depth 1] [--repeats 2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from loraplex.worker.model.config import SiglipVisionConfig
from loraplex.worker.model.gemma3_vision import MultiModalProjector, SiglipVisionModel
from loraplex.worker.parallel import tensor_parallel

FULL_DEPTH = 27


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=1, help=f"tower blocks (gemma-3-4b-it has {FULL_DEPTH})")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.set_default_dtype(getattr(torch, args.dtype))
    config = SiglipVisionConfig(depth=args.depth, hidden_size=1152, intermediate_size=4304, num_heads=16,
                                in_channels=3, image_size=896, patch_size=14, layer_norm_eps=1e-6,
                                mm_tokens_per_image=256, out_hidden_size=2560, image_token_id=0)  # fmt: skip
    with tensor_parallel(0, 1):
        tower, projector = SiglipVisionModel(config), MultiModalProjector(config)
    generator = torch.Generator().manual_seed(0)
    for param in [*tower.parameters(), *projector.parameters()]:
        param.data.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    pixels = torch.randn(1, 3, config.image_size, config.image_size)
    projector(tower(pixels))  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        projector(tower(pixels))
        times.append(time.perf_counter() - start)
    ms = 1000 * min(times)
    print(json.dumps({"patches": config.patches_per_side**2, "tokens": config.mm_tokens_per_image,
                      "depth": args.depth, "dtype": args.dtype, "ms_per_image": round(ms, 1),
                      f"ms_per_image_at_{FULL_DEPTH}_blocks": round(ms * FULL_DEPTH / args.depth, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
