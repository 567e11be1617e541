"""The vision tower's cost per image (worker/model/qwen2_5_vl_vision.py) at Qwen2.5-VL-3B's tower widths (hidden 1280,
16 heads, MLP 3420, merger to 2048; random weights), with fewer blocks than its 32 unless told: milliseconds per image
of a given size, and the tower's share of a prefill cut into chunks when each chunk re-encodes the image (what
worker/images.py's kept embeddings save). `--family qwen3_vl`: Qwen3-VL's tower (worker/model/qwen3_vl_vision.py) at
Qwen3-VL-2B's widths (hidden 1024, 16 heads, MLP 4096, patches of 16, merger and deepstack mergers to 2048; 24 blocks).
`--family gemma4`: Gemma 4's tower and embedder (worker/model/gemma4_vision.py) at gemma-4-e2b-it's widths (hidden
768, 12 heads of 64, MLP 3072, 16 layers, 16-pixel patches pooled 3x3, into 2304), times scaled to its 16 layers.

    python -m scripts.bench.vision_encode [--family qwen2_5_vl|qwen3_vl|gemma4] [--size 448] [--depth 4] [--repeats 3]
        [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from loraplex.worker.model.config import Gemma4VisionConfig, VisionConfig
from loraplex.worker.model.qwen2_5_vl_vision import VisionTower
from loraplex.worker.model.qwen3_vl_vision import Qwen3VLVisionTower
from loraplex.worker.parallel import tensor_parallel

FULL_DEPTH = {"qwen2_5_vl": 32, "qwen3_vl": 24, "gemma4": 16}


def gemma4_config(depth: int) -> Gemma4VisionConfig:
    return Gemma4VisionConfig.from_dict({"vision_config": {"num_hidden_layers": depth}, "text_config": {}})


def gemma4_tower(depth: int, size: int) -> tuple[torch.nn.Module, torch.Tensor, list[int], int, int]:
    """(encode(pixels, grids), pixels, grid, soft tokens, the full depth) for a size x size image."""
    from loraplex.worker.model.gemma4_vision import Gemma4VisionEmbedder, Gemma4VisionTower

    config = gemma4_config(depth)
    with tensor_parallel(0, 1):
        tower, embedder = Gemma4VisionTower(config), Gemma4VisionEmbedder(config)
    dtype = torch.get_default_dtype()
    side = size // config.patch_size
    side -= side % config.spatial_merge_size
    pixels = torch.rand(side * side, 3 * config.patch_size**2)

    def encode(pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        return embedder(tower(pixels, grids), dtype)

    module = torch.nn.ModuleList([tower, embedder])
    module.forward = encode
    return module, pixels, [1, side, side], side * side // config.spatial_merge_size**2, FULL_DEPTH["gemma4"]


def tower_config(depth: int) -> VisionConfig:
    return VisionConfig(depth=depth, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                        patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, window_size=112,
                        fullatt_block_indexes=tuple(i for i in (7, 15, 23, 31) if i < depth) or (depth - 1,),
                        rope_theta=10000.0, image_token_id=0)  # fmt: skip


def qwen3_vl_tower_config(depth: int) -> VisionConfig:
    return VisionConfig(depth=depth, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                        patch_size=16, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, window_size=0,
                        fullatt_block_indexes=(), rope_theta=10000.0, image_token_id=0, hidden_act="gelu_pytorch_tanh",
                        kind="qwen3_vl", num_position_embeddings=2304,
                        deepstack_indexes=tuple(i for i in (5, 11, 17) if i < depth))  # fmt: skip


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FULL_DEPTH), default="qwen2_5_vl")
    parser.add_argument("--size", type=int, default=448, help="image side in pixels (of 28; qwen3_vl: 32)")
    parser.add_argument("--depth", type=int, default=4, help="tower blocks (the 3B has 32, Qwen3-VL-2B 24; time "
                        "scales with it)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.set_default_dtype(getattr(torch, args.dtype))
    if args.family == "gemma4":
        tower, pixels, grid, tokens, full = gemma4_tower(args.depth, args.size)
    else:
        qwen3 = args.family == "qwen3_vl"
        config = (qwen3_vl_tower_config if qwen3 else tower_config)(args.depth)
        with tensor_parallel(0, 1):
            tower = (Qwen3VLVisionTower if qwen3 else VisionTower)(config)
        side = args.size // config.patch_size
        grid = [1, side, side]
        pixels = torch.randn(side * side, 3 * 2 * config.patch_size**2)
        tokens, full = side * side // 4, FULL_DEPTH[args.family]
    generator = torch.Generator().manual_seed(0)
    for param in tower.parameters():
        param.data.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    tower(pixels, [grid])  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        tower(pixels, [grid])
        times.append(time.perf_counter() - start)
    ms = 1000 * min(times)
    print(json.dumps({"family": args.family, "size": args.size, "patches": grid[1] * grid[2], "tokens": tokens,
                      "depth": args.depth, "dtype": args.dtype, "ms_per_image": round(ms, 1),
                      f"ms_per_image_at_{full}_blocks": round(ms * full / args.depth, 1),
                      "encodes_without_keeping_at_chunk_64": -(-tokens // 64)}))  # fmt: skip


if __name__ == "__main__":
    main()
