"""A tiny random Llama 4 with its vision model (Llama4ForConditionalGeneration, built locally with transformers), its
tokenizer (the tests' own with Llama 4's image tokens and a chat template that leaves `<|image|>` per image) and
preprocessor_config.json; PEFT adapters of it; the reference's processed inputs (no tests here).

The language model is tests/llama4_models.py's (MoE, chunked attention, a NoPE layer); the vision model two layers of
width 32, tiles of 16 pixels in 4x4 patches: 16 patches and a class token a tile, pixel-shuffled into 4 placeholder
rows. At most 4 tiles an image: a 32x16 image is 2x1 tiles and a global tile."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from tests.llama4_models import CONFIG as TEXT_CONFIG

IMAGE_TOKENS = ("<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
                "<|tile_y_separator|>")  # fmt: skip
TILE = 16
MAX_TILES = 4
VISION = dict(
    hidden_size=32,
    intermediate_size=128,  # hidden / pixel_shuffle_ratio**2: the shuffled rows' width
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=TILE,
    patch_size=4,
    pixel_shuffle_ratio=0.5,
    projector_input_dim=48,
    projector_output_dim=48,
    vision_output_dim=48,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}{{ '<|image|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tokenizer():  # -> transformers.PreTrainedTokenizerFast with the image tokens and chat template
    from tests.builders import make_tokenizer as make_text_tokenizer

    tokenizer = make_text_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@functools.cache
def token_ids() -> dict[str, int]:
    tokenizer = make_tokenizer()
    return {token: tokenizer.convert_tokens_to_ids(token) for token in IMAGE_TOKENS}


def hf_config(**vision_overrides):  # -> transformers.Llama4Config
    from transformers import Llama4Config

    tokenizer = make_tokenizer()
    ids = token_ids()
    text = dict(TEXT_CONFIG, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    return Llama4Config(text_config=text, vision_config=dict(VISION, **vision_overrides),
                        boi_token_index=ids["<|image_start|>"], eoi_token_index=ids["<|image_end|>"],
                        image_token_index=ids["<|patch|>"], tie_word_embeddings=False)  # fmt: skip


def write_preprocessor_config(out_dir: Path) -> None:
    """Llama4ImageProcessor's file (written by hand: the class needs torchvision)."""
    config = {"image_processor_type": "Llama4ImageProcessor", "processor_class": "Llama4Processor",
              "size": {"height": TILE, "width": TILE}, "max_patches": MAX_TILES, "resize_to_max_canvas": False,
              "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255,
              "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
              "resample": 2}  # fmt: skip
    (out_dir / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")


@torch.no_grad()
def build_llama4_vl(out_dir: Path | str, seed: int = 0) -> None:
    """A random Llama4ForConditionalGeneration with its tokenizer and preprocessor_config.json beside it: norms
    near 1, routers of std 1 (experts clearly apart), the language model's other weights of std 0.3, the vision
    model's 0.1 (its activations grow through the patch embedding otherwise)."""
    from transformers import Llama4ForConditionalGeneration

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = Llama4ForConditionalGeneration(hf_config())  # float32 (.to() would cast its complex rotary table)
    generator = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        values = torch.randn(param.shape, generator=generator)
        if "norm" in name and name.endswith("weight"):
            param.copy_(1.0 + 0.1 * values)
        elif name.endswith("router.weight"):
            param.copy_(values)
        else:
            param.copy_(values * (0.3 if name.startswith("language_model.") else 0.1))
    model.save_pretrained(out_dir, safe_serialization=True)
    make_tokenizer().save_pretrained(out_dir)
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    write_preprocessor_config(out_dir)


# PEFT module names only the language model has: its attention's are the vision model's too (q/k/v/o_proj), so
# an adapter of the language model alone leaves the vision model out by name
LANGUAGE_ONLY = r".*(vision_model|multi_modal_projector).*"


def build_llama4_vl_adapter(base_dir: Path, out_dir: Path, r: int, alpha: int, targets: tuple[str, ...], seed: int,
                            tower: bool = False) -> None:  # fmt: skip
    """A PEFT LoRA adapter of the base (the language model alone unless `tower`), random A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import Llama4ForConditionalGeneration

    from tests.lora_helpers import randomize_adapter

    model = Llama4ForConditionalGeneration.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                        exclude_modules=None if tower else LANGUAGE_ONLY)  # fmt: skip
    peft_model = get_peft_model(model, config)
    randomize_adapter(peft_model, seed)
    peft_model.save_pretrained(out_dir)


@functools.lru_cache(maxsize=4)
def hf_llama4_vl(model_dir: str, adapter_dir: str | None = None):
    from transformers import Llama4ForConditionalGeneration

    model = Llama4ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()
