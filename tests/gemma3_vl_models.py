"""A tiny random Gemma 3 vision-language checkpoint (Gemma3ForConditionalGeneration) with its tokenizer and image
processor, HF's processed inputs for a prompt, and the ForwardReqs the scheduler would send (no tests here).

The language model is tests/gemma_helpers.py's tiny Gemma 3 (sliding window 8: an image's 16 placeholders reach past
it); the SigLIP tower is two blocks of width 32 over 32x32 images of 4x4 patches (8x8 patches), pooled 2x2 into 16
soft tokens an image. Prompts hold `<start_of_image>` where an image goes; Gemma 3's processor makes it
"\\n\\n<start_of_image>" + 16 x "<image_soft_token>" + "<end_of_image>\\n\\n" (hf_inputs does the same, as text)."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch
from loraplex.protocol.structs import ForwardReq, ImageInput

from tests.lora_helpers import randomize_adapter, slot_of
from tests.vision_models import test_image as make_image
from tests.worker_helpers import GREEDY

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 32, 4, 16
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE,
              patch_size=PATCH, vision_use_head=False)  # fmt: skip
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
# (prompt, images as (width, height, seed)): one image, two (the second not square: the processor resizes it), none
PROMPTS = {
    "one": (f"hello {BOI} what is it", [(32, 32, 0)]),
    "two": (f"{BOI} and {BOI} differ in", [(32, 32, 1), (40, 24, 2)]),
    "text": ("plain words with no picture at all", []),
}
# the language model's modules alone: the tower's attention is q/k/v_proj too
TOWER_ONLY = r".*vision_tower.*"
ADAPTERS = {"a4": (4, 8, ("q_proj", "v_proj")), "a8": (8, 16, ("q_proj", "k_proj", "v_proj", "o_proj"))}
LORA = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            max_loras_per_batch=2)  # fmt: skip
# --enable-tower-connector-lora: q/v_proj on the language model and the tower's attention both; out_proj, fc1 and fc2
# the tower's alone
# (named a16 for tests/lora_helpers.py's ids and slots)
TOWER_ADAPTERS = {"a16": (16, 32, ("q_proj", "v_proj", "out_proj", "fc1", "fc2"))}
TOWER_LORA = dict(LORA, enable_tower_connector_lora=True, lora_target_modules=["all"], max_loras_per_batch=3,
                  max_lora_rank=16)  # fmt: skip


def make_tokenizer():  # -> transformers.PreTrainedTokenizerFast with Gemma 3's image tokens and a chat template
    from tests.builders import make_tokenizer as make_text_tokenizer

    tokenizer = make_text_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [BOI, EOI, SOFT, "<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_image_processor():  # -> Gemma3ImageProcessorPil (no torchvision)
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


@functools.cache
def token_ids() -> dict[str, int]:
    tokenizer = make_tokenizer()
    return {token: tokenizer.convert_tokens_to_ids(token) for token in (BOI, EOI, SOFT)}


def hf_config(**text_overrides):  # -> transformers.Gemma3Config
    from transformers import Gemma3Config

    from tests.gemma_helpers import gemma_config

    tokenizer, ids = make_tokenizer(), token_ids()
    text = gemma_config("gemma3_text", vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, **text_overrides)  # fmt: skip
    return Gemma3Config(text_config=text.to_dict(), vision_config=dict(VISION), mm_tokens_per_image=TOKENS_PER_IMAGE,
                        boi_token_index=ids[BOI], eoi_token_index=ids[EOI], image_token_index=ids[SOFT],
                        tie_word_embeddings=True)  # fmt: skip


@torch.no_grad()
def build_gemma3_vl(out_dir: Path | str, seed: int = 0) -> None:
    """Random weights (norms' offsets too), saved with the tokenizer and image processor as a Hub checkpoint has
    them."""
    from transformers import Gemma3ForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = Gemma3ForConditionalGeneration(hf_config()).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        std = 0.1 if "vision_tower" in name or "projector" in name else 0.3
        if "norm" in name and name.endswith("weight"):
            std = 0.2
        param.copy_(torch.randn(param.shape, generator=generator) * std)
        if "layer_norm" in name and name.endswith("weight") or "layernorm" in name and name.endswith("weight"):
            param.add_(1.0)  # LayerNorm scales around 1
    model.save_pretrained(out_dir, safe_serialization=True)
    make_tokenizer().save_pretrained(out_dir)
    make_image_processor().save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"  # the generic class name loads under any transformers
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")


def build_adapter(base_dir: Path, out_dir: Path, r: int, alpha: int, targets: tuple[str, ...], seed: int,
                  target_modules=None) -> None:  # fmt: skip
    """A PEFT LoRA adapter of the base (keys model.language_model.layers.N...), random A and B: `targets` on the
    language model alone, or `target_modules` wherever they match."""
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float32)
    exclude = None if target_modules is not None else TOWER_ONLY
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules or list(targets), exclude_modules=exclude)
    peft_model = get_peft_model(model, config)
    randomize_adapter(peft_model, seed)
    peft_model.save_pretrained(out_dir)


def build_set(root: Path, tower: bool = False) -> tuple[Path, dict[str, Path]]:
    """The base under root/base, ADAPTERS (on the language model) beside it, and with `tower` TOWER_ADAPTERS."""
    build_gemma3_vl(root / "base")
    adapters = {}
    for seed, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items()):
        adapters[name] = root / name
        build_adapter(root / "base", adapters[name], r, alpha, targets, seed)
    for seed, (name, (r, alpha, targets)) in enumerate(TOWER_ADAPTERS.items() if tower else (), start=len(adapters)):
        adapters[name] = root / name
        build_adapter(root / "base", adapters[name], r, alpha, targets, seed, target_modules=list(targets))
    return root / "base", adapters


def hf_inputs(prompt: str, images: list) -> dict:
    """What Gemma3Processor gives for one prompt: each `<start_of_image>` expanded as text, tokenized, the image
    processor's pixel_values, and token_type_ids marking the soft tokens (HF's bidirectional blocks)."""
    tokenizer = make_tokenizer()
    full = "\n\n" + BOI + SOFT * TOKENS_PER_IMAGE + EOI + "\n\n"
    pieces = prompt.split(BOI)
    assert len(pieces) == len(images) + 1
    text = pieces[0] + "".join(full + piece for piece in pieces[1:])
    input_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = {"input_ids": input_ids, "token_type_ids": (input_ids == token_ids()[SOFT]).long()}
    if images:
        out["pixel_values"] = make_image_processor()(images=images, return_tensors="pt")["pixel_values"].float()
    return out


def inputs(key: str) -> dict:
    text, images = PROMPTS[key]
    return hf_inputs(text, [make_image(*image) for image in images])


def image_inputs(hf: dict) -> list[ImageInput]:
    """The frontend's ImageInputs for HF's processed prompt: each image's pixels and placeholder run."""
    ids = hf["input_ids"][0].tolist()
    soft = token_ids()[SOFT]
    starts = [i for i, t in enumerate(ids) if t == soft and (i == 0 or ids[i - 1] != soft)]
    out = []
    for start, pixels in zip(starts, hf.get("pixel_values", torch.zeros(0)), strict=True):
        data = pixels[None].contiguous().numpy().tobytes()
        out.append(ImageInput(offset=start, num_tokens=TOKENS_PER_IMAGE, content_hash=hashlib.sha256(data).hexdigest(),
                              pixel_values=data, shape=[1, *pixels.shape]))  # fmt: skip
    return out


def request(hf: dict, pages: list[int], name: str | None = None, start: int = 0, end: int | None = None,
            key: int = 0) -> ForwardReq:  # fmt: skip
    """The pass over prompt tokens [start, end): the images overlapping them."""
    ids = hf["input_ids"][0].tolist()
    end = len(ids) if end is None else end
    images = [i for i in image_inputs(hf) if i.offset < end and i.offset + i.num_tokens > start]
    return ForwardReq(input_ids=ids[start:end], num_cached_tokens=start, page_ids=pages, sampling=GREEDY,
                      slot=slot_of(name), req_key=key, images=images)  # fmt: skip


@functools.lru_cache(maxsize=4)
def hf_model(model_dir: str, adapter_dir: str | None = None):
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


@torch.inference_mode()
def hf_logits(model_dir: Path, hf: dict, adapter_dir: Path | None = None, extra: list[int] = ()) -> torch.Tensor:
    """(len, vocab) of the prompt (and `extra` text tokens after it), the image blocks bidirectional."""
    hf = dict(hf)
    if extra:
        hf["input_ids"] = torch.cat([hf["input_ids"], torch.tensor([list(extra)])], dim=1)
        hf["token_type_ids"] = torch.cat([hf["token_type_ids"], torch.zeros(1, len(extra), dtype=torch.long)], 1)
    model = hf_model(str(model_dir), None if adapter_dir is None else str(adapter_dir))
    return model(**hf).logits[0]
