"""Llama 4's vision model and projector per tile (worker/model/llama4_vision.py) at Llama 4 Scout's widths (hidden
1408, 16 heads, MLP 5632, tiles of 336 pixels in 14-pixel patches: 576 patches and a class token, 144 placeholder rows
a tile; adapter to 4096, projector to 5120; random weights), with fewer encoder layers than its 34 unless told:
milliseconds per tile, scaled to 34 layers, and per image of --tiles tiles (a 2x2 canvas and its global tile: 5).

    python -m scripts.bench.llama4_vision_encode [--depth 4] [--tiles 5] [--repeats 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from loraplex.worker.model.config import Llama4VisionConfig
from loraplex.worker.model.llama4_vision import Llama4Projector, Llama4VisionModel
from loraplex.worker.parallel import tensor_parallel

FULL_DEPTH = 34


def scout_config(depth: int) -> Llama4VisionConfig:
    return Llama4VisionConfig(num_layers=depth, hidden_size=1408, intermediate_size=5632, num_heads=16, image_size=336,
                              patch_size=14, in_channels=3, pixel_shuffle_ratio=0.5, projector_input_dim=4096,
                              projector_output_dim=4096, vision_output_dim=4096, out_hidden_size=5120,
                              rope_theta=10000.0, image_token_id=0)  # fmt: skip


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=4, help="encoder layers (Scout has 34; time scales with it)")
    parser.add_argument("--tiles", type=int, default=5, help="tiles an image takes (its global tile included)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.set_default_dtype(getattr(torch, args.dtype))
    config = scout_config(args.depth)
    with tensor_parallel(0, 1):
        tower, projector = Llama4VisionModel(config), Llama4Projector(config)
    generator = torch.Generator().manual_seed(0)
    for param in [*tower.parameters(), *projector.parameters()]:
        param.data.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    pixels = torch.randn(args.tiles, 3, config.image_size, config.image_size)

    def encode() -> torch.Tensor:
        return projector(tower(pixels))  # (tiles, 144, 5120)

    encode()  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        encode()
        times.append(time.perf_counter() - start)
    ms = 1000 * min(times)
    print(json.dumps({"tiles": args.tiles, "tokens": args.tiles * config.tokens_per_tile, "depth": args.depth,
                      "dtype": args.dtype, "ms_per_image": round(ms, 1),
                      "ms_per_tile_at_34_layers": round(ms * FULL_DEPTH / args.depth / args.tiles, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
