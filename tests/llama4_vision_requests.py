"""Llama 4 image requests for the worker tests (no tests here): the prompts, the reference's inputs (the prompt text
as Llama4Processor lays each image out, the tiles of frontend/multimodal/llama4.py's image processor, which
reproduces the reference's, whose own needs torchvision), the ForwardReqs the scheduler would send, the adapters and
HF (+ peft) logits."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from loraplex.frontend.multimodal.llama4 import Llama4ImageProcessor
from loraplex.protocol.structs import ForwardReq, ImageInput

from tests.llama4_vision_models import (
    MAX_TILES,
    TILE,
    VISION,
    build_llama4_vl,
    build_llama4_vl_adapter,
    hf_llama4_vl,
    make_tokenizer,
    token_ids,
)
from tests.lora_helpers import slot_of
from tests.vision_models import test_image as make_image
from tests.worker_helpers import GREEDY

IMG = "<|image|>"
TOKENS_PER_TILE = (TILE // VISION["patch_size"]) ** 2 // 4
# (prompt, images as (width, height, seed)): one image of one tile, two (2x1 tiles + global; 1x2 + global), none
PROMPTS = {
    "one": (f"hello {IMG} what is it", [(16, 16, 0)]),
    "two": (f"{IMG} and {IMG} differ in", [(20, 40, 1), (32, 14, 2)]),
    "text": ("plain words with no picture at all", []),
}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTERS = {"a4": (4, 8, ("q_proj", "v_proj")), "a8": (8, 16, (*ATTENTION, "gate_proj", "up_proj", "down_proj"))}
LORA = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
            "gate_proj", "up_proj", "down_proj"], max_loras_per_batch=2)  # fmt: skip
# --enable-tower-connector-lora: an adapter on the language model's attention and on the vision model's (q/v_proj
# reach both), its encoder MLPs and pixel-shuffle adapter (fc1, fc2) and the projector (linear_1); named a16 for
# tests/lora_helpers.py's ids and slots
TOWER_ADAPTERS = {"a16": (16, 32, ("q_proj", "v_proj", "fc1", "fc2", "linear_1"))}
TOWER_LORA = dict(LORA, enable_tower_connector_lora=True, max_loras_per_batch=3, max_lora_rank=16)


def build_llama4_vl_set(root: Path, tower: bool = False) -> tuple[Path, dict[str, Path]]:
    """The tiny Llama 4 base under root/base, ADAPTERS (and with `tower` TOWER_ADAPTERS) beside it."""
    build_llama4_vl(root / "base")
    adapters = {}
    for seed, (name, (r, alpha, targets)) in enumerate({**ADAPTERS, **(TOWER_ADAPTERS if tower else {})}.items()):
        adapters[name] = root / name
        build_llama4_vl_adapter(root / "base", adapters[name], r, alpha, targets, seed + 1,
                                tower=name in TOWER_ADAPTERS)
    return root / "base", adapters


def hf_inputs(prompt: str, images: list) -> dict:
    """input_ids with each `<|image|>` replaced by Llama4Processor's text for its image, and pixel_values (every
    tile of every image in order, float32)."""
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    processor = Llama4ImageProcessor(size=TILE, max_patches=MAX_TILES)
    tiled = [processor(image) for image in images]
    pieces = prompt.split(IMG)
    assert len(pieces) == len(images) + 1
    text = pieces[0]
    for image, piece in zip(tiled, pieces[1:], strict=True):
        text += Llama4Processor._prompt_split_image(None, image.aspect, TOKENS_PER_TILE) + piece
    input_ids = make_tokenizer()(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = {"input_ids": input_ids}
    if images:
        out["pixel_values"] = torch.cat([torch.frombuffer(bytearray(tile), dtype=torch.float32).view(1, 3, TILE, TILE)
                                         for image in tiled for tile in image.tiles])  # fmt: skip
    return out


def inputs(key: str) -> dict:
    text, images = PROMPTS[key]
    return hf_inputs(text, [make_image(*image) for image in images])


def image_inputs(hf: dict) -> list[ImageInput]:
    """One ImageInput per tile: its run of `<|patch|>` placeholders (in order, as the tiles)."""
    ids = hf["input_ids"][0].tolist()
    patch = token_ids()["<|patch|>"]
    starts = [i for i, t in enumerate(ids) if t == patch and (i == 0 or ids[i - 1] != patch)]
    tiles = hf["pixel_values"] if starts else []
    out = []
    for start, tile in zip(starts, tiles, strict=True):
        data = tile.contiguous().numpy().tobytes()
        out.append(ImageInput(offset=start, num_tokens=TOKENS_PER_TILE, content_hash=hashlib.sha256(data).hexdigest(),
                              pixel_values=data, shape=[1, 3, TILE, TILE]))  # fmt: skip
    return out


def request(hf: dict, pages: list[int], name: str | None = None, start: int = 0, end: int | None = None,
            key: int = 0) -> ForwardReq:  # fmt: skip
    """The pass over prompt tokens [start, end): the tiles whose runs overlap them."""
    ids = hf["input_ids"][0].tolist()
    end = len(ids) if end is None else end
    images = [i for i in image_inputs(hf) if i.offset < end and i.offset + i.num_tokens > start]
    return ForwardReq(input_ids=ids[start:end], num_cached_tokens=start, page_ids=pages, sampling=GREEDY,
                      slot=slot_of(name), req_key=key, images=images)  # fmt: skip


@torch.inference_mode()
def hf_logits(model_dir: Path, hf: dict, adapter_dir: Path | None = None, extra: list[int] = ()) -> torch.Tensor:
    """(len, vocab) of the prompt (and `extra` tokens after it)."""
    hf = dict(hf)
    if extra:
        hf["input_ids"] = torch.cat([hf["input_ids"], torch.tensor([list(extra)])], dim=1)
    model = hf_llama4_vl(str(model_dir), None if adapter_dir is None else str(adapter_dir))
    return model(**hf).logits[0]
