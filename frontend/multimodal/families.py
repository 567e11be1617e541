"""Which image layout a checkpoint takes, from its config.json: Gemma 3's own (gemma3.py), Llama 4's tiles
(llama4.py), or vision.py's placeholder runs from the image's grid; None when the model takes no images. Above the
families' modules, so that none of them imports another."""

from __future__ import annotations

import json
import os
from typing import Any

from loraplex.frontend.multimodal.gemma3 import gemma3_spec
from loraplex.frontend.multimodal.llama4 import Llama4Spec, llama4_spec
from loraplex.frontend.multimodal.vision import VisionSpec, generic_vision_spec


def read_vision_spec(model_dir: str) -> VisionSpec | Llama4Spec | None:
    """The model's VisionSpec (Llama 4's own Llama4Spec), or None when it takes no images (a text model, or a
    multimodal checkpoint served as its language model)."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return None
    if hf.get("model_type") == "llama4":
        return llama4_spec(hf, model_dir) if isinstance(hf.get("vision_config"), dict) else None
    return vision_spec(hf, model_dir)


def vision_spec(hf: dict[str, Any], model_dir: str | None = None) -> VisionSpec | None:
    if hf.get("model_type") == "gemma3":  # its images laid out as Gemma3Processor does, with its tokenizer
        return gemma3_spec(hf, model_dir)
    return generic_vision_spec(hf)
