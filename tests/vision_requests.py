"""Qwen2.5-VL requests for the worker tests (no tests here): the prompts, HF's processed inputs and the ForwardReqs
the scheduler would send for them (images overlapping the pass, M-RoPE rows sliced), PEFT adapters of the VL model,
and the HF (+ peft) reference logits."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch
from loraplex.protocol.mrope import mrope_positions
from loraplex.protocol.structs import ForwardReq, ImageInput

from tests.lora_helpers import randomize_adapter, slot_of
from tests.vision_models import IMAGE_PAD, MERGE, VISION_END, VISION_START, hf_inputs, make_tokenizer
from tests.vision_models import test_image as make_image
from tests.worker_helpers import GREEDY

IMG = VISION_START + IMAGE_PAD + VISION_END
# (prompt, images as (width, height, seed)): one image (16 placeholders), two of different sizes (the second 3x5
# merged patches: windows of 2x2, 2x1, 1x2 and 1x1 at its edges), none
PROMPTS = {
    "one": (f"hello {IMG} what is it", [(32, 32, 0)]),
    "two": (f"{IMG} and {IMG} differ in", [(32, 32, 1), (40, 24, 2)]),
    "text": ("plain words with no picture at all", []),
}
# target names the language model alone has (the tower's are qkv / proj / its MLP's gate_up / down)
ADAPTERS = {"a4": (4, 8, ("q_proj", "v_proj")), "a8": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj"))}
LORA = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            max_loras_per_batch=2)  # fmt: skip


# --enable-tower-connector-lora: an adapter on the language model and on the tower's attention, MLP and merger
# (gate_proj / down_proj reach both the language model's MLPs and the tower's)
# (named a16 for tests/lora_helpers.py's ids and slots)
# ("proj" alone would reach the patch embedding's Conv3d too, which takes no adapter)
TOWER_ADAPTERS = {
    "a16": (16, 32, ("q_proj", "v_proj", "gate_proj", "down_proj", "qkv", "attn.proj", "mlp.0", "mlp.2")),
}
TOWER_LORA = dict(LORA, enable_tower_connector_lora=True, lora_target_modules=["all"], max_loras_per_batch=3,
                  max_lora_rank=16)  # fmt: skip


def build_vl_set(root: Path, tower: bool = False, build=None, tower_adapters: dict | None = None
                 ) -> tuple[Path, dict[str, Path]]:  # fmt: skip
    """The tiny Qwen2.5-VL base (or `build(dir)`'s) under root/base and ADAPTERS (and with `tower` TOWER_ADAPTERS, or
    `tower_adapters`) beside it."""
    from tests.vision_models import build_qwen2_5_vl

    (build or build_qwen2_5_vl)(root / "base")
    adapters = {}
    tower_adapters = (tower_adapters or TOWER_ADAPTERS) if tower else {}
    for seed, (name, (r, alpha, targets)) in enumerate({**ADAPTERS, **tower_adapters}.items()):
        adapters[name] = root / name
        build_vl_adapter(root / "base", adapters[name], r, alpha, targets, seed)
    return root / "base", adapters


def build_vl_adapter(base_dir: Path, out_dir: Path, r: int, alpha: int, targets: tuple[str, ...], seed: int,
                     target_parameters: tuple[str, ...] = ()) -> None:  # fmt: skip
    """A PEFT LoRA adapter of the VL base (Qwen2.5-VL, Qwen3-VL), saved by peft (keys
    model.language_model.layers.N...), random A and B; target_parameters: stacked experts (Qwen3-VL-MoE's)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                  target_parameters=list(target_parameters) or None))
    randomize_adapter(peft_model, seed)
    peft_model.save_pretrained(out_dir)


@functools.lru_cache(maxsize=4)
def hf_vl(model_dir: str, adapter_dir: str | None = None):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def inputs(key: str, image_processor=None) -> dict:
    """HF's inputs for a prompt of PROMPTS (with the token types its M-RoPE reads); image_processor: another
    family's (tests/vision_models.hf_inputs)."""
    text, images = PROMPTS[key]
    return hf_inputs(text, [make_image(*image) for image in images], image_processor)


@functools.cache
def image_token_id() -> int:
    return make_tokenizer().convert_tokens_to_ids(IMAGE_PAD)


@torch.inference_mode()
def hf_logits(model_dir: Path, hf: dict, adapter_dir: Path | None = None, extra: list[int] = ()) -> torch.Tensor:
    """(len, vocab) of the prompt (and `extra` text tokens after it)."""
    hf = dict(hf)
    if extra:
        hf["input_ids"] = torch.cat([hf["input_ids"], torch.tensor([list(extra)])], dim=1)
        hf["mm_token_type_ids"] = torch.cat([hf["mm_token_type_ids"], torch.zeros(1, len(extra), dtype=torch.int)], 1)
    model = hf_vl(str(model_dir), None if adapter_dir is None else str(adapter_dir))
    return model(**hf).logits[0]


def image_inputs(hf: dict) -> list[ImageInput]:
    """The frontend's ImageInputs for HF's processed prompt: each image's patches, grid and placeholder run."""
    ids = hf["input_ids"][0].tolist()
    token = image_token_id()
    grids = hf.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long)).tolist()
    patches = hf["pixel_values"].float().split([t * h * w for t, h, w in grids]) if grids else []
    starts = [i for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != token)]
    out = []
    for start, grid, pixels in zip(starts, grids, patches, strict=True):
        data = pixels.contiguous().numpy().tobytes()
        out.append(ImageInput(offset=start, num_tokens=grid[0] * grid[1] * grid[2] // MERGE**2,
                              content_hash=hashlib.sha256(data + str(grid).encode()).hexdigest(),
                              pixel_values=data, shape=list(pixels.shape), grid_thw=grid))  # fmt: skip
    return out


def request(hf: dict, pages: list[int], name: str | None = None, start: int = 0, end: int | None = None,
            key: int = 0) -> ForwardReq:  # fmt: skip
    """The pass over prompt tokens [start, end) as the scheduler slices it: the images overlapping them, their
    M-RoPE rows."""
    ids = hf["input_ids"][0].tolist()
    end = len(ids) if end is None else end
    images = image_inputs(hf)
    rows, delta = mrope_positions(ids, image_token_id(), [image.grid_thw for image in images], MERGE)
    return ForwardReq(
        input_ids=ids[start:end], num_cached_tokens=start, page_ids=pages, sampling=GREEDY, slot=slot_of(name),
        req_key=key, images=[i for i in images if i.offset < end and i.offset + i.num_tokens > start],
        mrope_positions=[row[start:end] for row in rows] if images else [], mrope_delta=delta,
    )  # fmt: skip


