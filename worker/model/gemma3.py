"""Gemma 3 text decoder: Gemma 2's (gemma2.py) with per-head q/k RMSNorms before rotary, the local layers' own rope
base (ModelConfig.local_rope) and, in the published configs, no soft-capping (the config says).

A multimodal `gemma3` checkpoint serves its language model only: its text tensors are read under the names the text
model has, and the vision tower's are skipped (loraplex takes text prompts; an image part is refused by the API)."""

from __future__ import annotations

from loraplex.worker.layers.norm import GemmaRMSNorm
from loraplex.worker.model.gemma2 import Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model
from loraplex.worker.model.qwen3 import Qwen3Attention


class Gemma3Attention(Qwen3Attention):
    """Qwen3's per-head q and k norms, with Gemma's RMSNorm."""

    qk_norm_cls = GemmaRMSNorm


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3Model(Gemma2Model):
    layer_cls = Gemma3DecoderLayer


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma3Model
    # Checkpoint name prefixes -> ours (worker/loader.py): the multimodal checkpoints' language model, as
    # transformers 4 (language_model.model.*) and 5 (model.language_model.*) save it; None = not loaded.
    checkpoint_prefixes = (
        ("language_model.model.", "model."),
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("vision_tower.", None),
        ("model.vision_tower.", None),
        ("multi_modal_projector.", None),
        ("model.multi_modal_projector.", None),
    )
