"""Tiny random Gemma 4 checkpoints with images (Gemma4ForConditionalGeneration: tests/gemma4_models.py's dense
language model beside a vision tower), their image processor and tokenizer, PEFT adapters, HF's processed inputs and
the ForwardReqs the scheduler would send for them (no tests here).

The tower is two layers of width 32 (2 heads of 16), 4x4 patches pooled 2x2; the image processor's smallest budget
(70 soft tokens, 280 patches) resizes every image to fit, keeping its aspect: a 32x32 image becomes 64x64 pixels,
16x16 patches, 64 soft tokens between its begin and end tokens."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch
from loraplex.protocol.structs import ForwardReq, ImageInput

from tests.gemma4_models import DENSE
from tests.lora_helpers import randomize_adapter, slot_of
from tests.vision_models import test_image as make_image
from tests.worker_helpers import GREEDY

BOI, IMAGE, EOI = "<|image>", "<|image|>", "<image|>"
OTHER_TOKENS = ("<|audio|>", "<|video|>", "<|audio>", "<audio|>")
PATCH, POOL, MAX_SOFT_TOKENS = 4, 2, 70

VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    patch_size=PATCH,
    pooling_kernel_size=POOL,
    position_embedding_size=64,
    rope_parameters={"rope_type": "axial", "rope_theta": 100.0},
)
# the chat template leaves one image token per image part; the server wraps and expands it as the processor does
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}{{ '<|image|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
# (prompt, images as (width, height, seed)): one image, two of different shapes, none
PROMPTS = {
    "one": (f"hello {IMAGE} what is it", [(32, 32, 0)]),
    "two": (f"{IMAGE} and {IMAGE} differ in", [(32, 32, 1), (40, 24, 2)]),
    "text": ("plain words with no picture at all", []),
}
# the language model's modules (the tower's q_proj ... wrap their linear, which PEFT cannot take: excluded)
ADAPTERS = {"a4": (4, 8, ("q_proj", "v_proj")), "a8": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"))}
NOT_THE_TOWER = r".*vision_tower.*"
LORA = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
            "down_proj"], max_loras_per_batch=2)  # fmt: skip
# --enable-tower-connector-lora: the language model's q/v, every linear inside the tower's clippable projections
# (their wrappers excluded) and the embedder's projection; named a16 for tests/lora_helpers.py's ids and slots
TOWER_ADAPTERS = {"a16": (16, 32, ("q_proj", "v_proj", "linear", "embedding_projection"))}
TOWER_WRAPPERS = r".*vision_tower.*_proj"
TOWER_LORA = dict(LORA, enable_tower_connector_lora=True, max_loras_per_batch=3, max_lora_rank=16)


def make_tokenizer():  # -> PreTrainedTokenizerFast with the image tokens and chat template
    from tests.builders import make_tokenizer as make_text_tokenizer

    tokenizer = make_text_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [BOI, IMAGE, EOI, *OTHER_TOKENS]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_image_processor():  # -> Gemma4ImageProcessorPil (torchvision is not a dependency)
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(patch_size=PATCH, pooling_kernel_size=POOL, max_soft_tokens=MAX_SOFT_TOKENS)


@functools.cache
def token_ids() -> dict[str, int]:
    tokenizer = make_tokenizer()
    return {token: tokenizer.convert_tokens_to_ids(token) for token in (BOI, IMAGE, EOI, *OTHER_TOKENS)}


def hf_config(**text_overrides):  # -> transformers.Gemma4Config
    from transformers import Gemma4Config

    ids, vocab = token_ids(), len(make_tokenizer())
    text = dict(DENSE, vocab_size=vocab, vocab_size_per_layer_input=vocab, bos_token_id=None, eos_token_id=None,
                **text_overrides)  # fmt: skip
    return Gemma4Config(text_config=text, vision_config=dict(VISION), image_token_id=ids[IMAGE],
                        boi_token_id=ids[BOI], eoi_token_id=ids[EOI], audio_token_id=ids["<|audio|>"],
                        video_token_id=ids["<|video|>"], boa_token_id=ids["<|audio>"],
                        eoa_token_index=ids["<audio|>"], tie_word_embeddings=True)  # fmt: skip


@torch.no_grad()
def build_gemma4_vl(out_dir: Path | str, seed: int = 0, **text_overrides) -> None:
    """A random Gemma4ForConditionalGeneration with its tokenizer (chat template included) and image processor
    beside it: norms and layer scalars near 1, the rest of std 0.3 (the tower's 0.2, its position table 0.5)."""
    from transformers import Gemma4ForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = Gemma4ForConditionalGeneration(hf_config(**text_overrides)).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        values = torch.randn(param.shape, generator=generator)
        if name.endswith(("norm.weight", "layer_scalar")):
            param.copy_(1.0 + 0.1 * values)
        elif "position_embedding_table" in name:
            param.copy_(values * 0.5)
        else:
            param.copy_(values * (0.2 if "vision" in name else 0.3))
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(out_dir)
    make_image_processor().save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"  # the generic class loads anywhere
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")


def build_adapter(base_dir: Path, out_dir: Path, r: int, alpha: int, targets: tuple[str, ...], seed: int,
                  exclude: str | None = NOT_THE_TOWER) -> None:  # fmt: skip
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), exclude_modules=exclude)
    peft_model = get_peft_model(model, config)
    randomize_adapter(peft_model, seed)
    peft_model.save_pretrained(out_dir)


def build_gemma4_vl_set(root: Path, tower: bool = False) -> tuple[Path, dict[str, Path]]:
    """The tiny base under root/base and ADAPTERS (and with `tower` TOWER_ADAPTERS) beside it."""
    build_gemma4_vl(root / "base")
    adapters = {}
    for seed, (name, (r, alpha, targets)) in enumerate({**ADAPTERS, **(TOWER_ADAPTERS if tower else {})}.items()):
        adapters[name] = root / name
        exclude = TOWER_WRAPPERS if name in TOWER_ADAPTERS else NOT_THE_TOWER
        build_adapter(root / "base", adapters[name], r, alpha, targets, seed, exclude)
    return root / "base", adapters


def hf_inputs(prompt: str, images: list) -> dict:
    """What Gemma4Processor gives for one prompt (its audio and video halves aside): the image processor's padded
    pixel_values and image_position_ids, and input_ids with each image token expanded to begin, its soft tokens'
    placeholders, end."""
    tokenizer, processor = make_tokenizer(), make_image_processor()
    vision = processor(images=images, return_tensors="pt") if images else {}
    pieces = prompt.split(IMAGE)
    expanded = pieces[0]
    for count, piece in zip(vision.get("num_soft_tokens_per_image", []), pieces[1:], strict=True):
        expanded += BOI + IMAGE * int(count) + EOI + piece
    input_ids = tokenizer(expanded, return_tensors="pt", add_special_tokens=False)["input_ids"]
    # image tokens 1, text 0: with use_bidirectional_attention "vision" an image's tokens see its run whole
    out = {"input_ids": input_ids, "mm_token_type_ids": (input_ids == token_ids()[IMAGE]).int()}
    if images:
        out.update(pixel_values=vision["pixel_values"], image_position_ids=vision["image_position_ids"])
    return out


def inputs(key: str) -> dict:
    text, images = PROMPTS[key]
    return hf_inputs(text, [make_image(*image) for image in images])


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str, adapter_dir: str | None = None):
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


@torch.inference_mode()
def hf_logits(model_dir: Path, hf: dict, adapter_dir: Path | None = None, extra: list[int] = ()) -> torch.Tensor:
    """(len, vocab) of the prompt (and `extra` text tokens after it)."""
    hf = dict(hf)
    if extra:
        hf["input_ids"] = torch.cat([hf["input_ids"], torch.tensor([list(extra)])], dim=1)
        hf["mm_token_type_ids"] = torch.cat([hf["mm_token_type_ids"], torch.zeros(1, len(extra), dtype=torch.int)], 1)
    model = hf_model(str(model_dir), None if adapter_dir is None else str(adapter_dir))
    return model(**hf).logits[0]


def image_inputs(hf: dict) -> list[ImageInput]:
    """The frontend's ImageInputs for HF's processed prompt: each image's patches without the padding, its (1, h, w)
    grid and its placeholder run."""
    ids = hf["input_ids"][0].tolist()
    token = token_ids()[IMAGE]
    starts = [i for i, t in enumerate(ids) if t == token and ids[i - 1] != token]
    out = []
    for start, pixels, xy in zip(starts, hf.get("pixel_values", []), hf.get("image_position_ids", []), strict=True):
        real = (xy != -1).all(-1)
        pixels, xy = pixels[real].float().contiguous(), xy[real]
        grid = [1, int(xy[:, 1].max()) + 1, int(xy[:, 0].max()) + 1]
        data = pixels.numpy().tobytes()
        out.append(ImageInput(offset=start, num_tokens=grid[1] * grid[2] // POOL**2,
                              content_hash=hashlib.sha256(data + str(grid).encode()).hexdigest(),
                              pixel_values=data, shape=list(pixels.shape), grid_thw=grid))  # fmt: skip
    return out


def request(hf: dict, pages: list[int], name: str | None = None, start: int = 0, end: int | None = None,
            key: int = 0) -> ForwardReq:  # fmt: skip
    """The pass over prompt tokens [start, end) with the images overlapping them."""
    ids = hf["input_ids"][0].tolist()
    end = len(ids) if end is None else end
    images = [i for i in image_inputs(hf) if i.offset < end and i.offset + i.num_tokens > start]
    return ForwardReq(input_ids=ids[start:end], num_cached_tokens=start, page_ids=pages, sampling=GREEDY,
                      slot=slot_of(name), req_key=key, images=images)  # fmt: skip
