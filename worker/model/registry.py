"""model_type -> the class that runs it; one file per family under worker/model/. A decoder's class follows from its
model_type; an encoder's (BERT) from its architecture as well (embeddings or a classifier head)."""

from __future__ import annotations

from loraplex.worker.model.bert import bert_model_class
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.deepseek_v3 import DeepseekV3ForCausalLM
from loraplex.worker.model.gemma2 import Gemma2ForCausalLM
from loraplex.worker.model.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from loraplex.worker.model.gemma4 import Gemma4ForCausalLM
from loraplex.worker.model.glm4_moe import Glm4MoeForCausalLM
from loraplex.worker.model.gpt_oss import GptOssForCausalLM
from loraplex.worker.model.llama import LlamaForCausalLM
from loraplex.worker.model.llama4 import Llama4ForCausalLM, Llama4ForConditionalGeneration
from loraplex.worker.model.mixtral import MixtralForCausalLM
from loraplex.worker.model.olmoe import OlmoeForCausalLM
from loraplex.worker.model.phi3 import Phi3ForCausalLM
from loraplex.worker.model.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from loraplex.worker.model.qwen3 import Qwen3ForCausalLM
from loraplex.worker.model.qwen3_5 import Qwen3_5ForCausalLM
from loraplex.worker.model.qwen3_moe import Qwen3MoeForCausalLM
from loraplex.worker.model.qwen3_next import Qwen3NextForCausalLM
from loraplex.worker.model.qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration
from torch import nn

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "olmoe": OlmoeForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
    "gemma3": Gemma3ForConditionalGeneration,  # with its SigLIP tower and projector
    "gemma4_text": Gemma4ForCausalLM,  # its MLPs are dense MLPs beside experts with enable_moe_block
    "gemma4": Gemma4ForCausalLM,  # the language model of the multimodal checkpoint
    "phi3": Phi3ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,  # the language model of the multimodal checkpoint
    "qwen3_5_moe_text": Qwen3_5ForCausalLM,  # its MLPs are MoE blocks (ModelConfig.moe)
    "qwen3_5_moe": Qwen3_5ForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "llama4_text": Llama4ForCausalLM,
    "llama4": Llama4ForCausalLM,  # the multimodal checkpoint's language model (with a vision_config: its tower too)
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,  # with its vision tower
    "qwen3_vl": Qwen3VLForConditionalGeneration,  # with its vision tower and deepstack
    "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration,  # the same with Qwen3-MoE's layers
}


def build_model(config: ModelConfig, max_positions: int) -> nn.Module:
    """The model for config.model_type (ModelConfig already refused any type missing here)."""
    if config.model_type == "bert":
        return bert_model_class(config)(config, max_positions=max_positions)
    if config.model_type == "llama4" and config.vision is not None:
        return Llama4ForConditionalGeneration(config, max_positions=max_positions)
    return MODEL_CLASSES[config.model_type](config, max_positions=max_positions)
