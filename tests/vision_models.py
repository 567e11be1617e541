"""Tiny random Qwen2.5-VL checkpoints with their processor, built locally with transformers, and test images (no
tests here).

The language model is the tests' usual size; the vision tower is two blocks of width 32 (one windowed, one full), 4x4
patches merged 2x2, so a 32x32 image is 8x8 patches and 16 placeholder tokens. The image processor's pixel limits
keep every image small whatever its size on disk.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

PATCH = 4
MERGE = 2
# The image processor resizes every image to a multiple of PATCH * MERGE within these pixel counts.
MIN_PIXELS = 8 * 8
MAX_PIXELS = 64 * 64

VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    in_channels=3,
    patch_size=PATCH,
    spatial_merge_size=MERGE,
    temporal_patch_size=2,
    window_size=16,  # in pixels: 16 / PATCH / MERGE = 2x2 merged patches a window
    fullatt_block_indexes=[1],
    out_hidden_size=64,
    tokens_per_second=2,
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    # mrope: the rotary halves split 4 (time) + 2 (height) + 2 (width) of head_dim 16's 8 frequencies
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tokenizer():  # -> transformers.PreTrainedTokenizerFast with the vision tokens and chat template
    from tests.builders import make_tokenizer as make_text_tokenizer

    tokenizer = make_text_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_image_processor():  # -> Qwen2VLImageProcessorPil (the PIL backend: torchvision is not a dependency)
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                    min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)  # fmt: skip


def hf_inputs(prompt: str, images: list, image_processor=None) -> dict:
    """What Qwen2_5_VLProcessor gives for one prompt (its video half needs torchvision): the image processor's
    pixel_values and image_grid_thw, the prompt's input_ids with each image's placeholder repeated once per merged
    patch, and mm_token_type_ids marking those placeholders. image_processor: another family's (Qwen3-VL's), which
    places its tokens alike; default this file's."""
    tokenizer, image_processor = make_tokenizer(), image_processor or make_image_processor()
    vision = image_processor(images=images, return_tensors="pt") if images else {}
    pieces = prompt.split(IMAGE_PAD)
    assert len(pieces) == len(images) + 1, (len(pieces) - 1, len(images))
    expanded = pieces[0]
    for grid, piece in zip(vision.get("image_grid_thw", []), pieces[1:], strict=True):
        expanded += IMAGE_PAD * (int(grid.prod()) // MERGE**2) + piece
    input_ids = tokenizer(expanded, return_tensors="pt", add_special_tokens=False)["input_ids"]
    # Which tokens are an image's (1) or text (0): without it transformers' forward takes 1-D positions.
    mm_token_type_ids = (input_ids == tokenizer.convert_tokens_to_ids(IMAGE_PAD)).int()
    return {"input_ids": input_ids, "mm_token_type_ids": mm_token_type_ids, **dict(vision)}


def hf_config(**text_overrides):  # -> transformers.Qwen2_5_VLConfig
    from transformers import Qwen2_5_VLConfig

    tokenizer = make_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    return Qwen2_5_VLConfig(
        text_config=dict(TEXT, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **text_overrides),  # fmt: skip
        vision_config=dict(VISION),
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
    )


@torch.no_grad()
def build_qwen2_5_vl(out_dir: Path | str, seed: int = 0, init_std: float = 0.35, **text_overrides) -> None:
    """A random Qwen2_5_VLForConditionalGeneration with its tokenizer (chat template included) and image processor
    saved beside it, as a Hub checkpoint has them. Norms 1, every other weight and bias of std init_std (the vision
    tower's 0.1: its activations grow through the patch embedding otherwise)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration(hf_config(**text_overrides))
    save_random_vl(model, make_image_processor(), out_dir, seed, init_std)


@torch.no_grad()
def save_random_vl(model, image_processor, out_dir: Path | str, seed: int, init_std: float) -> None:
    """`model` (a transformers VL model) with random weights (norms 1, the vision tower's std 0.1, the rest
    init_std), saved with this file's tokenizer and `image_processor`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if "norm" in name and name.endswith("weight"):
            param.fill_(1.0)
        else:
            std = 0.1 if "visual" in name else init_std
            param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out_dir, safe_serialization=True)
    image_processor.save_pretrained(out_dir)
    save_tokenizer(out_dir)


def save_tokenizer(out_dir: Path) -> None:
    """make_tokenizer()'s files (the vision tokens and chat template) in out_dir."""
    make_tokenizer().save_pretrained(out_dir)
    # transformers 5 names its own backend class here; the generic name loads anywhere.
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")


def test_image(width: int = 32, height: int = 32, seed: int = 0):  # -> PIL.Image.Image
    """A deterministic RGB image of random pixels."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()
