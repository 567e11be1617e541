"""A vision tower's cost per image at a published checkpoint's widths (random weights), with fewer blocks than the
checkpoint has unless told: milliseconds per image of a given size, scaled to the full depth, and for the Qwen-VL and
Gemma 4 towers the number of tower calls a prefill cut into 64-token chunks would make without worker/images.py's
kept embeddings. The families:

- `qwen2_5_vl` (worker/model/qwen2_5_vl_vision.py): Qwen2.5-VL-3B (hidden 1280, 16 heads, MLP 3420, merger to 2048;
  32 blocks).
- `qwen3_vl` (worker/model/qwen3_vl_vision.py): Qwen3-VL-2B (hidden 1024, 16 heads, MLP 4096, patches of 16, merger
  and deepstack mergers to 2048; 24 blocks).
- `gemma3` (worker/model/gemma3_vision.py): gemma-3-4b-it's SigLIP tower and pooling projector (hidden 1152, 16
  heads, MLP 4304, 896x896 images of 14x14 patches pooled to 256 soft tokens; 27 blocks); the image is always 896.
- `gemma4` (worker/model/gemma4_vision.py): gemma-4-e2b-it's tower and embedder (hidden 768, 12 heads of 64, MLP
  3072, 16-pixel patches pooled 3x3, into 2304; 16 layers).
- `llama4` (worker/model/llama4_vision.py): Llama 4 Scout's vision model and projector (hidden 1408, 16 heads, MLP
  5632, 336-pixel tiles of 14-pixel patches: 144 rows a tile; 34 layers); an image is `--tiles` tiles (a 2x2 canvas
  and its global tile: 5), whatever `--size`.

    python -m scripts.bench.vision_encode [--family qwen2_5_vl|qwen3_vl|gemma3|gemma4|llama4] [--size 448]
        [--depth 4] [--tiles 5] [--repeats 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from loraplex.worker.model.config import Gemma4VisionConfig, Llama4VisionConfig, SiglipVisionConfig, VisionConfig
from loraplex.worker.parallel import tensor_parallel


class Encoder(NamedTuple):
    encode: Callable[[], torch.Tensor]  # one image through the tower (and projector)
    modules: list[torch.nn.Module]  # whose parameters get random weights
    patches: int
    tokens: int  # the image's placeholder rows
    full_depth: int
    chunked: bool  # whether chunked prefill re-encodes the image without kept embeddings (grid-sized runs)


def qwen2_5_vl(depth: int, size: int, tiles: int) -> Encoder:
    from loraplex.worker.model.qwen2_5_vl_vision import VisionTower

    config = VisionConfig(depth=depth, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                          patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, window_size=112,
                          fullatt_block_indexes=tuple(i for i in (7, 15, 23, 31) if i < depth) or (depth - 1,),
                          rope_theta=10000.0, image_token_id=0)  # fmt: skip
    with tensor_parallel(0, 1):
        tower = VisionTower(config)
    return _qwen_grid(tower, config, size, full_depth=32)


def qwen3_vl(depth: int, size: int, tiles: int) -> Encoder:
    from loraplex.worker.model.qwen3_vl_vision import Qwen3VLVisionTower

    config = VisionConfig(depth=depth, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                          patch_size=16, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, window_size=0,
                          fullatt_block_indexes=(), rope_theta=10000.0, image_token_id=0,
                          hidden_act="gelu_pytorch_tanh", kind="qwen3_vl", num_position_embeddings=2304,
                          deepstack_indexes=tuple(i for i in (5, 11, 17) if i < depth))  # fmt: skip
    with tensor_parallel(0, 1):
        tower = Qwen3VLVisionTower(config)
    return _qwen_grid(tower, config, size, full_depth=24)


def _qwen_grid(tower: torch.nn.Module, config: VisionConfig, size: int, full_depth: int) -> Encoder:
    side = size // config.patch_size
    pixels = torch.randn(side * side, 3 * 2 * config.patch_size**2)
    return Encoder(lambda: tower(pixels, [[1, side, side]]), [tower], side * side, side * side // 4, full_depth, True)


def gemma3(depth: int, size: int, tiles: int) -> Encoder:
    from loraplex.worker.model.gemma3_vision import MultiModalProjector, SiglipVisionModel

    config = SiglipVisionConfig(depth=depth, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3,
                                image_size=896, patch_size=14, layer_norm_eps=1e-6, mm_tokens_per_image=256,
                                out_hidden_size=2560, image_token_id=0)  # fmt: skip
    with tensor_parallel(0, 1):
        tower, projector = SiglipVisionModel(config), MultiModalProjector(config)
    pixels = torch.randn(1, 3, config.image_size, config.image_size)
    return Encoder(lambda: projector(tower(pixels)), [tower, projector], config.patches_per_side**2,
                   config.mm_tokens_per_image, 27, False)  # fmt: skip


def gemma4(depth: int, size: int, tiles: int) -> Encoder:
    from loraplex.worker.model.gemma4_vision import Gemma4VisionEmbedder, Gemma4VisionTower

    config = Gemma4VisionConfig.from_dict({"vision_config": {"num_hidden_layers": depth}, "text_config": {}})
    with tensor_parallel(0, 1):
        tower, embedder = Gemma4VisionTower(config), Gemma4VisionEmbedder(config)
    dtype = torch.get_default_dtype()
    side = size // config.patch_size
    side -= side % config.spatial_merge_size
    pixels = torch.rand(side * side, 3 * config.patch_size**2)
    return Encoder(lambda: embedder(tower(pixels, [[1, side, side]]), dtype), [tower, embedder], side * side,
                   side * side // config.spatial_merge_size**2, 16, True)  # fmt: skip


def llama4(depth: int, size: int, tiles: int) -> Encoder:
    from loraplex.worker.model.llama4_vision import Llama4Projector, Llama4VisionModel

    config = Llama4VisionConfig(num_layers=depth, hidden_size=1408, intermediate_size=5632, num_heads=16,
                                image_size=336, patch_size=14, in_channels=3, pixel_shuffle_ratio=0.5,
                                projector_input_dim=4096, projector_output_dim=4096, vision_output_dim=4096,
                                out_hidden_size=5120, rope_theta=10000.0, image_token_id=0)  # fmt: skip
    with tensor_parallel(0, 1):
        tower, projector = Llama4VisionModel(config), Llama4Projector(config)
    pixels = torch.randn(tiles, 3, config.image_size, config.image_size)
    patches = tiles * (config.image_size // config.patch_size) ** 2
    return Encoder(lambda: projector(tower(pixels)), [tower, projector], patches, tiles * config.tokens_per_tile, 34,
                   False)  # fmt: skip


FAMILIES = {f.__name__: f for f in (qwen2_5_vl, qwen3_vl, gemma3, gemma4, llama4)}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen2_5_vl")
    parser.add_argument("--size", type=int, default=448, help="image side in pixels (Qwen2.5-VL: of 28, Qwen3-VL: 32)")
    parser.add_argument("--depth", type=int, default=4, help="tower blocks (time scales with it)")
    parser.add_argument("--tiles", type=int, default=5, help="llama4: tiles an image takes (its global tile included)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.set_default_dtype(getattr(torch, args.dtype))
    encoder = FAMILIES[args.family](args.depth, args.size, args.tiles)
    generator = torch.Generator().manual_seed(0)
    for module in encoder.modules:
        for param in module.parameters():
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    encoder.encode()  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        encoder.encode()
        times.append(time.perf_counter() - start)
    ms = 1000 * min(times)
    row = {"family": args.family, "size": args.size, "patches": encoder.patches, "tokens": encoder.tokens,
           "depth": args.depth, "dtype": args.dtype, "ms_per_image": round(ms, 1),
           f"ms_per_image_at_{encoder.full_depth}_blocks": round(ms * encoder.full_depth / args.depth, 1)}  # fmt: skip
    if encoder.chunked:
        row["encodes_without_keeping_at_chunk_64"] = -(-encoder.tokens // 64)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
