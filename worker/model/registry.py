"""model_type -> the decoder class that runs it; one file per family under worker/model/."""

from __future__ import annotations

from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.llama import LlamaForCausalLM
from loraplex.worker.model.phi3 import Phi3ForCausalLM
from torch import nn

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "phi3": Phi3ForCausalLM,
}


def build_model(config: ModelConfig, max_positions: int) -> nn.Module:
    """The decoder for config.model_type (ModelConfig already refused any type missing here)."""
    return MODEL_CLASSES[config.model_type](config, max_positions=max_positions)
