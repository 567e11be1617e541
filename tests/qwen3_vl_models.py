"""Tiny random Qwen3-VL checkpoints with their processor, built locally with transformers (no tests here).

The tokenizer, chat template and placeholders are tests/vision_models.py's (Qwen3-VL's are Qwen2.5-VL's); the image
processor is Qwen3-VL's (patches of 16, merged 2x2, mean and std 0.5), its pixel limits scaling a 32x32 image up to
128x128: 8x8 patches, 16 placeholder tokens. The tower: three blocks of width 32, deepstack mergers after the first
two (whose rows the two decoder layers add), learned positions on a 4x4 grid (resampled to every image's grid). The
decoder rotates head_dim 16's 8 frequencies by interleaved M-RoPE (t h w t h w t t).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.vision_models import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, make_tokenizer, save_random_vl

PATCH = 16
MERGE = 2
MIN_PIXELS = 128 * 128
MAX_PIXELS = 256 * 256
TOKENS_PER_32PX_IMAGE = 16

VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    in_channels=3,
    patch_size=PATCH,
    spatial_merge_size=MERGE,
    temporal_patch_size=2,
    out_hidden_size=64,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 1],
    hidden_act="gelu_pytorch_tanh",
)
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                     "mrope_interleaved": True},
)
# PEFT target names of an adapter on the language model and on the tower's attention, MLP, merger and deepstack
# mergers (linear_fc1/2 name the tower's MLP and every merger's); named a16 for tests/lora_helpers.py's ids and slots
TOWER_ADAPTERS = {
    "a16": (16, 32, ("q_proj", "v_proj", "gate_proj", "down_proj", "qkv", "attn.proj", "linear_fc1", "linear_fc2")),
}


def make_image_processor():  # -> Qwen2VLImageProcessorPil, Qwen3-VL's settings (transformers maps qwen3_vl to it)
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2, min_pixels=MIN_PIXELS,
                                    max_pixels=MAX_PIXELS, image_mean=[0.5] * 3, image_std=[0.5] * 3)  # fmt: skip


def hf_config(**text_overrides):  # -> transformers.Qwen3VLConfig
    from transformers import Qwen3VLConfig

    tokenizer = make_tokenizer()
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)}
    return Qwen3VLConfig(
        text_config=dict(TEXT, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **text_overrides),  # fmt: skip
        vision_config=dict(VISION),
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
    )


def build_qwen3_vl(out_dir: Path | str, seed: int = 0, init_std: float = 0.35, **text_overrides) -> None:
    """A random Qwen3VLForConditionalGeneration with its tokenizer and image processor saved beside it."""
    from transformers import Qwen3VLForConditionalGeneration

    with torch.no_grad():
        save_random_vl(Qwen3VLForConditionalGeneration(hf_config(**text_overrides)), make_image_processor(), out_dir,
                       seed, init_std)  # fmt: skip


# Qwen3-VL-MoE's decoder: every layer's MLP 4 experts of 48, top 2 (2 x 48 is not the hidden 64, so a stacked
# expert tensor's layout shows in its shape)
MOE_TEXT = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=1)


def build_qwen3_vl_moe(out_dir: Path | str, seed: int = 0, init_std: float = 0.35) -> None:
    """A random Qwen3VLMoeForConditionalGeneration (this file's tower, MOE_TEXT's layers) saved as build_qwen3_vl
    saves its model (transformers 5 writes the stacked experts (experts, out, in))."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    dense = hf_config(**MOE_TEXT).to_dict()
    tokens = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    # (its text config keeps Qwen3VLMoeTextConfig's tie_word_embeddings True: transformers ties by the outer False)
    config = Qwen3VLMoeConfig(text_config=dense["text_config"], vision_config=dict(VISION), tie_word_embeddings=False,
                              **{key: dense[key] for key in tokens})  # fmt: skip
    with torch.no_grad():
        save_random_vl(Qwen3VLMoeForConditionalGeneration(config), make_image_processor(), out_dir, seed, init_std)
