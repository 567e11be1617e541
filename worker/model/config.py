from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "olmoe", "qwen3_moe", "gemma2", "gemma3_text",
                         "gemma3", "phi3", "deepseek_v3", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text",
                         "qwen3_next", "glm4_moe", "llama4_text", "llama4",
                         "gpt_oss", "gemma4_text", "gemma4", "bert", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
GEMMA4_TYPES = ("gemma4_text", "gemma4")
GEMMA_TYPES = ("gemma2", "gemma3_text", "gemma3", *GEMMA4_TYPES)
LLAMA4_TYPES = ("llama4_text", "llama4")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")  # last: Gemma 4


class ModelConfigError(ValueError):
    pass


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    # Scaling parameters of rope_type, as in the HF config; `original_max_position_embeddings` filled in where
    # transformers fills it in (llama3, yarn, longrope).
    params: dict[str, Any] = field(default_factory=dict)
    partial_rotary_factor: float = 1.0  # the leading fraction of each head that is rotated (Phi-4-mini: 0.75)
    max_position_embeddings: int = 2048  # the model's, which dynamic, yarn and longrope scale against

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)  # as transformers rounds it


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts fields of a config.json (Mixtral, OLMoE, Qwen3-MoE)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # of each expert
    renormalize: bool  # the top-k weights rescaled to sum to 1 (Mixtral always; OLMoE/Qwen3-MoE: norm_topk_prob)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP of ModelConfig.intermediate_size instead
    # DeepSeek-V3's router: sigmoid scores, experts chosen (with a correction bias) within the best `topk_group` of
    # `num_groups` groups, weights scaled by `routed_scaling_factor`; and shared experts beside the routed ones.
    num_groups: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # of the shared experts' one MLP (DeepSeek-V3; Qwen3-Next and Qwen3.5-MoE: its output scaled by sigmoid of a
    # one-output gate); 0: none
    shared_intermediate_size: int = 0
    # Llama 4: each chosen expert's routing weight (sigmoid of its logit) scales the expert's input, not its output
    weight_scales_input: bool = False
    # the name checkpoints and adapters give the shared expert that LoRA reaches (`mlp.shared_experts` here):
    # DeepSeek-V3's `shared_experts`; Llama 4's, Qwen3-Next's and Qwen3.5-MoE's `shared_expert`; Gemma 4's `mlp` (its
    # layer's dense MLP, which runs beside the experts); None: refused
    shared_expert_name: str | None = "shared_experts"
    # the stacked expert tensors are (experts, in, out) (Llama 4), unmarked as transposed in transformers, so PEFT's
    # target_parameters LoRA reads them as (experts, out, in): its A and B change roles (worker/lora/expert_weights.py)
    stacked_in_out: bool = False
    # gpt-oss's experts: biases on every expert linear and on the router, softmax over the top-k logits alone, and a
    # clamped SwiGLU (gate clamped above, up on both sides at `swiglu_limit`; gate * sigmoid(alpha * gate) * (up + 1))
    swiglu_limit: float | None = None  # None: silu(gate) * up
    swiglu_alpha: float = 1.0
    gate_up_interleaved: bool = False  # a stacked gate_up (weights, bias, an adapter's B) alternates gate and up rows

    @classmethod
    def from_dict(cls, hf: dict[str, Any], model_type: str) -> MoEConfig | None:
        if model_type not in _MOE_MODEL_TYPES:
            return None
        num_experts = hf.get("num_local_experts") or hf.get("num_experts")
        num_layers = hf["num_hidden_layers"]
        dense_layers: tuple[int, ...] = ()
        if model_type in ("qwen3_moe", "qwen3_next", "qwen3_vl_moe"):  # Qwen3MoeDecoderLayer's rule
            step = hf.get("decoder_sparse_step", 1) or 1
            only = set(hf.get("mlp_only_layers") or ())
            dense_layers = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
        extra: dict[str, Any] = {}
        if model_type in _GROUPED_SIGMOID_TYPES:  # DeepseekV3DecoderLayer's rule (GLM-4.5's too): the first k dense
            num_experts = hf["n_routed_experts"]
            dense_layers = tuple(range(min(hf.get("first_k_dense_replace", 0) or 0, num_layers)))
            extra = dict(num_groups=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                         routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                         shared_intermediate_size=hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0))
            if num_experts % extra["num_groups"]:
                raise ModelConfigError(f"n_group {extra['num_groups']} must divide n_routed_experts {num_experts}")
        if model_type in ("qwen3_next", *_QWEN3_5_MOE):  # one shared expert, gated (worker/layers/moe.py)
            extra = dict(shared_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
                         shared_expert_name="shared_expert")
        if model_type in LLAMA4_TYPES:  # Llama4TextConfig's moe_layers (from interleave_moe_layer_step)
            moe_layers = set(hf["moe_layers"])
            dense_layers = tuple(i for i in range(num_layers) if i not in moe_layers)
            extra = dict(shared_intermediate_size=hf["intermediate_size"], weight_scales_input=True,
                         shared_expert_name="shared_expert", stacked_in_out=True)
        if model_type == "gpt_oss":
            extra = dict(swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                         swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), gate_up_interleaved=True)
        if model_type in GEMMA4_TYPES:  # every layer: its dense MLP (`mlp.*`) beside the experts (`experts.*`)
            if not hf.get("enable_moe_block"):
                return None
            num_experts = hf["num_experts"]
            extra = dict(shared_intermediate_size=hf["intermediate_size"], shared_expert_name="mlp")
            hf = {**hf, "num_experts_per_tok": hf["top_k_experts"]}
        if model_type == "olmoe" and hf.get("clip_qkv") is not None:
            raise ModelConfigError(f"OLMoE with clip_qkv={hf['clip_qkv']} is not supported")
        return cls(
            num_experts=num_experts,
            top_k=hf["num_experts_per_tok"],
            intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
            renormalize=model_type in ("mixtral", *_QWEN3_5_MOE, *GEMMA4_TYPES, "qwen3_vl_moe")
            or bool(hf.get("norm_topk_prob", False)),
            dense_layers=dense_layers,
            **extra,
        )


_QWEN3_5_MOE = ("qwen3_5_moe", "qwen3_5_moe_text")  # every layer MoE, top-k always renormalised
# DeepSeek-V3's router, shared experts and leading dense layers (GLM-4.5 keeps them with plain attention)
_GROUPED_SIGMOID_TYPES = ("deepseek_v3", "glm4_moe")
_MOE_MODEL_TYPES = ("mixtral", "olmoe", "qwen3_moe", "qwen3_next", *_GROUPED_SIGMOID_TYPES, *_QWEN3_5_MOE,
                    *LLAMA4_TYPES, "gpt_oss", *GEMMA4_TYPES, "qwen3_vl_moe")
# Gated DeltaNet layers beside gated attention ones
HYBRID_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next", *_QWEN3_5_MOE)
MULTIMODAL_HYBRID_TYPES = ("qwen3_5", "qwen3_5_moe")  # served as their language model (text_config)
QWEN3_VL_TYPES = ("qwen3_vl", "qwen3_vl_moe")  # one vision tower; the second's decoder layers are Qwen3-MoE's
VISION_TYPES = ("qwen2_5_vl", *QWEN3_VL_TYPES)  # a language model (text_config, or the top level in older configs) and
# a vision tower


@dataclass(frozen=True)
class VisionConfig:
    """A Qwen-VL vision tower (vision_config) and the language model's image placeholder token: Qwen2.5-VL's
    (windowed blocks) or Qwen3-VL's (`kind` qwen3_vl: learned position embeddings, deepstack mergers)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the merger's output: the language model's hidden size
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    window_size: int  # in pixels: windowed blocks attend within (window_size / patch / merge)**2 merged patches
    fullatt_block_indexes: tuple[int, ...]  # the blocks that attend over a whole image
    rope_theta: float
    image_token_id: int
    hidden_act: str = "silu"
    kind: str = "qwen2_5_vl"  # the model_type whose tower this is
    num_position_embeddings: int = 0  # Qwen3-VL: a square grid of learned position embeddings, resampled per image
    deepstack_indexes: tuple[int, ...] = ()  # Qwen3-VL: the blocks whose output a deepstack merger takes

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, hf: dict[str, Any]) -> VisionConfig:
        vision = hf.get("vision_config") or {}
        text = hf.get("text_config") or {}
        kind = "qwen3_vl" if hf.get("model_type") in QWEN3_VL_TYPES else "qwen2_5_vl"
        act = vision.get("hidden_act", "silu")
        wanted = "gelu_pytorch_tanh" if kind == "qwen3_vl" else "silu"
        if act != wanted:
            raise ModelConfigError(f"unsupported vision hidden_act {act!r}; the vision tower runs {wanted}")
        if kind == "qwen3_vl":
            return cls(
                depth=vision["depth"],
                hidden_size=vision["hidden_size"],
                intermediate_size=vision["intermediate_size"],
                num_heads=vision["num_heads"],
                out_hidden_size=vision.get("out_hidden_size") or text.get("hidden_size") or hf["hidden_size"],
                patch_size=vision.get("patch_size", 16),
                temporal_patch_size=vision.get("temporal_patch_size", 2),
                spatial_merge_size=vision.get("spatial_merge_size", 2),
                in_channels=vision.get("in_channels", 3),
                window_size=0,
                fullatt_block_indexes=(),
                rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
                image_token_id=hf.get("image_token_id", text.get("image_token_id", 151655)),
                hidden_act=act,
                kind=kind,
                num_position_embeddings=vision.get("num_position_embeddings", 2304),
                deepstack_indexes=tuple(vision.get("deepstack_visual_indexes", (8, 16, 24))),
            )
        return cls(
            depth=vision["depth"],
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            num_heads=vision["num_heads"],
            out_hidden_size=vision.get("out_hidden_size") or text.get("hidden_size") or hf["hidden_size"],
            patch_size=vision.get("patch_size", 14),
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            spatial_merge_size=vision.get("spatial_merge_size", 2),
            in_channels=vision.get("in_channels", 3),
            window_size=vision.get("window_size", 112),
            fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))),
            rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            image_token_id=hf.get("image_token_id", text.get("image_token_id", 151655)),
        )


@dataclass(frozen=True)
class Gemma4VisionConfig(VisionConfig):
    """Gemma 4's vision tower (worker/model/gemma4_vision.py) in VisionConfig's terms, as worker/images.py checks an
    image: one frame (temporal_patch_size 1) of patch x patch RGB patches, spatial_merge_size the pooling kernel
    (k x k patches average into one soft token), no windows; and its own: explicit head width and KV heads, the
    patch position table's size, clipped linears, standardized soft tokens, and the text model's pad token (which
    an image token's per-layer input reads)."""

    vision_head_dim: int = 64
    num_kv_heads: int = 12
    position_embedding_size: int = 10_240
    use_clipped_linears: bool = False
    standardize: bool = False
    rms_norm_eps: float = 1e-6
    pad_token_id: int = 0
    # use_bidirectional_attention "vision": on the sliding layers an image's tokens also see its later ones
    # (worker/image_blocks.py)
    bidirectional: bool = False

    @property
    def head_dim(self) -> int:
        return self.vision_head_dim

    @classmethod
    def from_dict(cls, hf: dict[str, Any]) -> Gemma4VisionConfig:
        vision = hf.get("vision_config") or {}
        text = hf.get("text_config") or {}
        act = vision.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ModelConfigError(f"unsupported vision hidden_activation {act!r}; the vision tower runs "
                                   "gelu_pytorch_tanh")  # fmt: skip
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ModelConfigError(f"unsupported vision rope_type {rope.get('rope_type')!r}; Gemma 4's is axial")
        num_heads = vision.get("num_attention_heads", 12)
        return cls(
            depth=vision.get("num_hidden_layers", 16),
            hidden_size=vision.get("hidden_size", 768),
            intermediate_size=vision.get("intermediate_size", 3072),
            num_heads=num_heads,
            out_hidden_size=text.get("hidden_size", 2304),
            patch_size=vision.get("patch_size", 16),
            temporal_patch_size=1,
            spatial_merge_size=vision.get("pooling_kernel_size", 3),
            in_channels=3,
            window_size=0,
            fullatt_block_indexes=(),
            rope_theta=float(rope.get("rope_theta", 100.0)),
            image_token_id=hf.get("image_token_id", 258_880),
            hidden_act=act,
            vision_head_dim=vision.get("head_dim") or vision.get("hidden_size", 768) // num_heads,
            num_kv_heads=vision.get("num_key_value_heads") or num_heads,
            position_embedding_size=vision.get("position_embedding_size", 10_240),
            use_clipped_linears=bool(vision.get("use_clipped_linears", False)),
            standardize=bool(vision.get("standardize", False)),
            rms_norm_eps=vision.get("rms_norm_eps", 1e-6),
            pad_token_id=text.get("pad_token_id") if text.get("pad_token_id") is not None else 0,
            bidirectional=text.get("use_bidirectional_attention") == "vision",
        )


@dataclass(frozen=True)
class Llama4VisionConfig:
    """Llama 4's vision model (vision_config) and projector: every tile of image_size pixels a side is one sequence
    of (image_size / patch_size)**2 patches and a class token; pixel shuffle folds each 2x2 (1 / ratio a side) of
    patches into one row, so a tile takes tokens_per_tile placeholders (`<|patch|>`, image_token_id)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int  # the encoder MLP's width, and the pixel-shuffled rows' (hidden / ratio**2)
    num_heads: int
    image_size: int
    patch_size: int
    in_channels: int
    pixel_shuffle_ratio: float
    projector_input_dim: int
    projector_output_dim: int
    vision_output_dim: int  # the projector's input
    out_hidden_size: int  # the language model's hidden size
    rope_theta: float
    image_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        return int(self.patches_per_side**2 * self.pixel_shuffle_ratio**2)

    @classmethod
    def from_dict(cls, hf: dict[str, Any]) -> Llama4VisionConfig:
        vision = hf.get("vision_config") or {}
        text = hf.get("text_config") or {}
        return cls(
            num_layers=vision.get("num_hidden_layers", 34),
            hidden_size=vision.get("hidden_size", 768),
            intermediate_size=vision.get("intermediate_size", 5632),
            num_heads=vision.get("num_attention_heads", 16),
            image_size=vision.get("image_size", 448),
            patch_size=vision.get("patch_size", 14),
            in_channels=vision.get("num_channels", 3),
            pixel_shuffle_ratio=float(vision.get("pixel_shuffle_ratio", 0.5)),
            projector_input_dim=vision.get("projector_input_dim", 4096),
            projector_output_dim=vision.get("projector_output_dim", 4096),
            vision_output_dim=vision.get("vision_output_dim", 7680),
            out_hidden_size=text.get("hidden_size", 5120),
            rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", vision.get("rope_theta", 1e4))),
            image_token_id=hf.get("image_token_index", hf.get("image_token_id", 200092)),
        )

    def check(self) -> None:
        """Before the tower is built (transformers' defaults alone do not make a tower that runs)."""
        c = self
        shuffled = int(c.hidden_size / c.pixel_shuffle_ratio**2)
        if c.intermediate_size != shuffled or c.projector_input_dim != c.projector_output_dim:
            raise ModelConfigError(f"llama4 vision_config: intermediate_size {c.intermediate_size} must be hidden_size "
                                   f"/ pixel_shuffle_ratio**2 ({shuffled}) and projector_input_dim "
                                   f"{c.projector_input_dim} equal projector_output_dim {c.projector_output_dim}")
        if c.vision_output_dim != c.projector_output_dim:
            raise ModelConfigError(f"llama4 vision_config: vision_output_dim {c.vision_output_dim} must equal "
                                   f"projector_output_dim {c.projector_output_dim} (the projector reads the adapter's "
                                   "output)")

    def image_problem(self, shape: list[int], num_tokens: int, num_bytes: int) -> str | None:
        """Why a tile (ImageInput) cannot go through this tower, or None."""
        expected = [1, self.in_channels, self.image_size, self.image_size]
        if list(shape) != expected:
            return f"image tile pixel_values of shape {shape}, expected {expected}"
        if num_bytes != 4 * self.in_channels * self.image_size**2:
            return f"image tile pixel_values hold {num_bytes} bytes, not float32 of shape {shape}"
        if num_tokens != self.tokens_per_tile:
            return f"an image tile has {self.tokens_per_tile} placeholder tokens, not {num_tokens}"
        return None


@dataclass(frozen=True)
class SiglipVisionConfig:
    """Gemma 3's SigLIP vision tower (vision_config) and its multi-modal projector: a fixed image_size square of
    (image_size / patch_size)**2 patches, average-pooled to mm_tokens_per_image rows (worker/model/gemma3_vision.py)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    mm_tokens_per_image: int
    out_hidden_size: int  # the language model's hidden size
    image_token_id: int
    hidden_act: str = "gelu_pytorch_tanh"
    # an image's placeholder run attends within itself both ways during prefill (SDPAAttention.image_blocks)
    bidirectional_images: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def spatial_merge_size(self) -> int:
        """The projector's pooling kernel: merge x merge patches average into one row (worker/lora/tower.py's
        patches-to-rows ratio)."""
        return self.patches_per_side // int(self.mm_tokens_per_image**0.5)

    @classmethod
    def from_dict(cls, hf: dict[str, Any]) -> SiglipVisionConfig:
        """SiglipVisionConfig's and Gemma3Config's defaults for the keys a Hub config.json leaves out."""
        vision = hf.get("vision_config") or {}
        text = hf.get("text_config") or {}
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ModelConfigError(f"unsupported vision hidden_act {act!r}; the SigLIP tower runs gelu_pytorch_tanh")
        config = cls(
            depth=vision.get("num_hidden_layers", 12),
            hidden_size=vision.get("hidden_size", 768),
            intermediate_size=vision.get("intermediate_size", 3072),
            num_heads=vision.get("num_attention_heads", 12),
            in_channels=vision.get("num_channels", 3),
            image_size=vision.get("image_size", 224),
            patch_size=vision.get("patch_size", 16),
            layer_norm_eps=vision.get("layer_norm_eps", 1e-6),
            mm_tokens_per_image=hf.get("mm_tokens_per_image", 256),
            out_hidden_size=text.get("hidden_size", 2304),
            image_token_id=hf.get("image_token_index", hf.get("image_token_id", 262_144)),
        )
        side = int(config.mm_tokens_per_image**0.5)
        if side * side != config.mm_tokens_per_image or config.patches_per_side % max(side, 1):
            raise ModelConfigError(f"mm_tokens_per_image {config.mm_tokens_per_image} does not pool the "
                                   f"{config.patches_per_side}x{config.patches_per_side} patches evenly")  # fmt: skip
        if config.hidden_size % config.num_heads:
            raise ModelConfigError(f"vision hidden_size {config.hidden_size} does not split into "
                                   f"{config.num_heads} heads")  # fmt: skip
        return config


@dataclass(frozen=True)
class LinearAttentionConfig:
    """A hybrid model's Gated DeltaNet layers (Qwen3.5): their heads, and which layers they are."""

    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads: each q/k head serves num_value_heads // num_key_heads
    key_head_dim: int
    value_head_dim: int
    conv_kernel_size: int  # the causal depthwise conv over q|k|v; its state holds the last kernel - 1 inputs
    layer_ids: tuple[int, ...]  # the linear-attention layers; the others are (gated) full attention
    state_dtype: str | None = None  # the states' dtype the checkpoint asks for (Qwen3.5: mamba_ssm_dtype float32)

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim  # q | k | v channels

    @classmethod
    def from_dict(cls, hf: dict[str, Any], model_type: str) -> LinearAttentionConfig | None:
        if model_type not in HYBRID_TYPES:
            return None
        num_layers = hf["num_hidden_layers"]
        layer_types = hf.get("layer_types")
        if layer_types is None:  # Qwen3.5's default: every full_attention_interval-th layer attends fully
            interval = hf.get("full_attention_interval", 4)
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
        layer_types = list(layer_types)[:num_layers]
        if len(layer_types) != num_layers or set(layer_types) - {"linear_attention", "full_attention"}:
            raise ModelConfigError(f"layer_types {layer_types} do not give one of linear_attention / "
                                   f"full_attention to each of {num_layers} layers")
        config = cls(
            num_key_heads=hf["linear_num_key_heads"],
            num_value_heads=hf["linear_num_value_heads"],
            key_head_dim=hf["linear_key_head_dim"],
            value_head_dim=hf["linear_value_head_dim"],
            conv_kernel_size=hf["linear_conv_kernel_dim"],
            layer_ids=tuple(i for i, kind in enumerate(layer_types) if kind == "linear_attention"),
            state_dtype=hf.get("mamba_ssm_dtype"),
        )
        if config.num_value_heads % config.num_key_heads:
            raise ModelConfigError(f"linear_num_value_heads {config.num_value_heads} is not a multiple of "
                                   f"linear_num_key_heads {config.num_key_heads}")
        return config


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): q through a low-rank q_a/q_b pair (or one q_proj), keys and
    values from one compressed latent of kv_lora_rank per token plus one rotary key shared by every head."""

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoint's rotary dims come in (even, odd) pairs
    softmax_scale: float  # qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """What the cache holds per token and layer: the normed latent, then the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, hf: dict[str, Any], rope: RopeConfig) -> MLAConfig:
        qk_head_dim = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
        scale = qk_head_dim**-0.5
        mscale_all_dim = rope.params.get("mscale_all_dim") if rope.rope_type != "default" else None
        if mscale_all_dim:  # as the reference's yarn_apply_mscale
            factor = rope.params["factor"]
            mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * mscale * mscale
        return cls(
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            rope_interleave=bool(hf.get("rope_interleave", True)),
            softmax_scale=scale,
        )


@dataclass(frozen=True)
class EncoderConfig:
    """A bidirectional encoder's own fields (BERT): what the decoders lack, and the head its checkpoint names."""

    type_vocab_size: int  # segment embeddings: 0 for a single text, 1 for the second text of a pair
    layer_norm_eps: float
    # BertForSequenceClassification: the pooler (dense + tanh on the first token) and a classifier of num_labels
    # outputs (a cross-encoder when 1); False: the encoder alone (sentence-transformers pools its hidden states)
    is_classifier: bool
    num_labels: int

    @classmethod
    def from_dict(cls, hf: dict[str, Any]) -> EncoderConfig:
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ModelConfigError(f"bert with position_embedding_type {hf['position_embedding_type']!r} is not "
                                   "supported; only 'absolute'")  # fmt: skip
        if hf.get("is_decoder") or hf.get("add_cross_attention"):
            raise ModelConfigError("bert as a decoder (is_decoder, add_cross_attention) is not supported")
        architectures = hf.get("architectures") or ["BertModel"]
        known = ("BertModel", "BertForSequenceClassification")
        if architectures[0] not in known:
            raise ModelConfigError(f"bert architecture {architectures[0]!r} is not supported; {' or '.join(known)}")
        labels = hf.get("id2label")
        return cls(
            type_vocab_size=hf.get("type_vocab_size", 2),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
            is_classifier=architectures[0] == "BertForSequenceClassification",
            num_labels=len(labels) if labels else hf.get("num_labels", 2),
        )


@dataclass(frozen=True)
class Gemma4Layers:
    """What Gemma 4's layers vary that Gemma 3's share, per layer: the full-attention layers' heads may be wider
    (`global_head_dim`) and fewer (`num_global_key_value_heads`, with `attention_k_eq_v`: their values are the keys'
    projection), the last `num_kv_shared_layers` layers attend over an earlier layer's keys and values (their MLPs
    twice as wide with `use_double_wide_mlp`); and per-layer inputs (PLE) of `per_layer_input_size` feed every layer."""

    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    values_are_keys: tuple[bool, ...]
    # the layer whose cached keys and values each layer attends over: itself, or for a KV-shared layer the last
    # layer of its kind before the shared ones
    kv_sources: tuple[int, ...]
    mlp_sizes: tuple[int, ...]
    per_layer_input_size: int  # 0: no per-layer inputs
    per_layer_vocab_size: int

    def is_kv_shared(self, layer_id: int) -> bool:
        return self.kv_sources[layer_id] != layer_id

    def cache_elements(self, layer_id: int, world_size: int) -> int:
        """Keys (or values) one token holds in this rank's cache of the layer."""
        return self.kv_heads[layer_id] // world_size * self.head_dims[layer_id]


@dataclass(frozen=True)
class ModelConfig:
    """The fields of an HF config.json that a Llama-family model needs, read in both transformers 4 and 5 forms."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None  # the window of the windowed layers; None = every layer attends to the whole context
    checkpoint_dtype: str | None
    initializer_range: float = 0.02  # std of HF's weight init (--load-format dummy draws with it)
    moe: MoEConfig | None = None  # None: a dense model
    hidden_act: str = "silu"
    # Per layer: its sliding window (a query at position p sees keys in (p - window, p]) or None for full attention.
    layer_windows: tuple[int | None, ...] = ()
    local_rope: RopeConfig | None = None  # the windowed layers' own rope (Gemma 3); None = `rope` on every layer
    query_pre_attn_scalar: float | None = None  # softmax scale = its ** -0.5; None = head_dim ** -0.5
    attn_logit_softcap: float | None = None  # attention scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    mla: MLAConfig | None = None  # latent attention (DeepSeek-V3); None: q/k/v heads
    linear_attention: LinearAttentionConfig | None = None  # hybrid models' Gated DeltaNet layers; None: none
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before rotary (GLM-4.5's use_qk_norm)
    # Per layer: the chunk of its chunked local attention (a query at p sees the keys of its own chunk up to p, chunks
    # [0, c), [c, 2c), ...) or None (Llama 4's RoPE layers are chunked, its NoPE layers global); () = none chunked.
    layer_chunks: tuple[int | None, ...] = ()
    nope_layers: tuple[int, ...] = ()  # layers without rotary (Llama 4's `no_rope_layers` zeros)
    qk_l2_norm: bool = False  # q and k RMS-normed without a weight after rotary, on the rotary layers (Llama 4)
    # (floor_scale, attn_scale) of Llama 4's attention-temperature tuning on its NoPE layers: q at position p scaled
    # by 1 + attn_scale * log1p(floor((p + 1) / floor_scale)); None: none
    attn_temperature: tuple[float, float] | None = None
    attention_sinks: bool = False  # a learned logit per head joins each softmax's denominator (gpt-oss)
    gemma4: Gemma4Layers | None = None  # Gemma 4's per-layer shapes, KV sharing and per-layer inputs
    encoder: EncoderConfig | None = None  # a bidirectional encoder (BERT); None: a decoder
    # a vision-language model's tower (Qwen-VL's, Gemma 4's, Llama 4's, Gemma 3's SigLIP); None: text only
    vision: VisionConfig | Llama4VisionConfig | SiglipVisionConfig | None = None

    @property
    def is_bidirectional(self) -> bool:
        """Every token attends to every token of its sequence, so a sequence is computed whole in one pass: no
        chunked prefill, no prefix cache, no decoding."""
        return self.encoder is not None

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """The layers with softmax attention, which alone hold KV cache."""
        linear = set(self.linear_attention.layer_ids) if self.linear_attention is not None else set()
        if self.gemma4 is not None:  # a KV-shared layer reads another layer's cache
            linear = {i for i in range(self.num_layers) if self.gemma4.is_kv_shared(i)}
        return tuple(i for i in range(self.num_layers) if i not in linear)

    def kv_layout(self, world_size: int) -> tuple[int, int, int]:
        """(parts, heads, head_dim) the paged cache holds per token and layer on one of `world_size` ranks: keys and
        values of this rank's KV heads, or with latent attention one part of one head, the latent and rope key,
        replicated on every rank."""
        if self.mla is not None:
            return 1, 1, self.mla.cache_dim
        g4 = self.gemma4
        if g4 is not None:  # the widest layer's; each other layer views the leading part of every token's slot
            widest = max(self.attention_layer_ids, key=lambda i: g4.cache_elements(i, world_size))
            return 2, g4.kv_heads[widest] // world_size, g4.head_dims[widest]
        return 2, self.num_kv_heads // world_size, self.head_dim

    @property
    def mixed_head_shapes(self) -> bool:
        """Whether the attention layers' (KV heads, head_dim) differ (Gemma 4's full and sliding layers)."""
        g4 = self.gemma4
        return g4 is not None and len({(g4.kv_heads[i], g4.head_dims[i]) for i in self.attention_layer_ids}) > 1

    @property
    def max_context_length(self) -> int:
        return self.max_position_embeddings

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def attention_window(self) -> int | None:
        """The most tokens any layer's query attends to, when every layer has a sliding window; None = some layer
        attends to the whole context (keys older than every window can then never be dropped)."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(self.layer_windows)

    def layer_window(self, layer_id: int) -> int | None:
        return self.layer_windows[layer_id] if self.layer_windows else None

    def layer_chunk(self, layer_id: int) -> int | None:
        return self.layer_chunks[layer_id] if self.layer_chunks else None

    @classmethod
    def from_dir(cls, model_dir: str, overrides: dict[str, Any] | None = None) -> ModelConfig:
        """config.json with `overrides` (--hf-overrides) merged in before any field is read."""
        if not os.path.isdir(model_dir):
            raise ModelConfigError(f"model directory {model_dir!r} does not exist")
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ModelConfigError(f"no config.json in model directory {model_dir!r}")
        with open(path) as f:
            return cls.from_dict(merge_overrides(json.load(f), overrides or {}))

    @classmethod
    def from_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        # a multimodal checkpoint's tower, read before its text_config replaces the config: Gemma 3's SigLIP, Gemma 4's
        # (its audio tower is not served); Qwen-VL's and Llama 4's below
        vision: VisionConfig | Llama4VisionConfig | SiglipVisionConfig | None = None  # Gemma 4's: a VisionConfig
        if model_type == "gemma3" and all(isinstance(hf.get(key), dict) for key in ("vision_config", "text_config")):
            vision = SiglipVisionConfig.from_dict(hf)
        if model_type in GEMMA4_TYPES:
            if isinstance(hf.get("vision_config"), dict):
                vision = Gemma4VisionConfig.from_dict(hf)
            hf = _gemma4_fields(hf, model_type)
        elif model_type in GEMMA_TYPES:
            hf = _gemma_fields(hf, model_type)
        if model_type in MULTIMODAL_HYBRID_TYPES and isinstance(hf.get("text_config"), dict):  # the language model
            hf = {"tie_word_embeddings": hf.get("tie_word_embeddings", False), **hf["text_config"],
                  "model_type": model_type}
        if model_type in VISION_TYPES:
            vision = VisionConfig.from_dict(hf)
        if model_type in VISION_TYPES and isinstance(hf.get("text_config"), dict):  # the language model
            outer = hf
            hf = {"tie_word_embeddings": hf.get("tie_word_embeddings", False), **hf["text_config"],
                  "model_type": model_type}
            if model_type in QWEN3_VL_TYPES and "tie_word_embeddings" in outer:  # transformers ties by the outer one
                hf["tie_word_embeddings"] = outer["tie_word_embeddings"]
        if model_type == "deepseek_v3":
            hf = _deepseek_v3_fields(hf)
        if model_type == "glm4_moe":
            hf = _glm4_moe_fields(hf)
        if model_type == "llama4" and isinstance(hf.get("vision_config"), dict):
            vision = Llama4VisionConfig.from_dict(hf)
        if model_type in LLAMA4_TYPES:
            hf = _llama4_fields(hf, model_type)
        hidden_act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        allowed_act = "gelu_pytorch_tanh" if model_type in GEMMA_TYPES else "gelu" if model_type == "bert" else "silu"
        if hidden_act != allowed_act:
            raise ModelConfigError(f"unsupported hidden_act {hidden_act!r}; {model_type} runs {allowed_act}")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        if model_type == "deepseek_v3":  # rotary runs over the rope part of each head alone
            head_dim = hf["qk_rope_head_dim"]
        # Phi-3's linears have no biases whatever attention_bias says (its HF code builds them without).
        attention_bias = bool(hf.get("attention_bias", False)) and model_type != "phi3" or model_type == "bert"
        is_qwen2 = model_type in ("qwen2", "qwen2_5_vl")
        sliding_window = _read_sliding_window(hf, model_type)
        rope = _read_rope(hf, model_type, head_dim)
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            # Llama 4's dense layers: intermediate_size_mlp (its intermediate_size is the experts')
            intermediate_size=hf.get("intermediate_size_mlp") or hf.get("intermediate_size")
            or hf["moe_intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope=rope,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and none on o_proj; Llama's attention_bias covers all four.
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=not is_qwen2 and attention_bias and model_type != "glm4_moe",  # GLM-4.5: biases on q, k, v only
            mlp_bias=bool(hf.get("mlp_bias", False)) and model_type != "phi3" or model_type == "bert",
            sliding_window=sliding_window,
            checkpoint_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            initializer_range=hf.get("initializer_range", 0.02),
            moe=MoEConfig.from_dict(hf, model_type),
            hidden_act=hidden_act,
            layer_windows=_read_layer_windows(hf, model_type, sliding_window),
            local_rope=_read_local_rope(hf, model_type, head_dim),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            attn_logit_softcap=hf.get("attn_logit_softcapping"),
            final_logit_softcap=hf.get("final_logit_softcapping"),
            linear_attention=LinearAttentionConfig.from_dict(hf, model_type),
            mla=MLAConfig.from_dict(hf, rope) if model_type == "deepseek_v3" else None,
            attention_sinks=model_type == "gpt_oss",
            qk_norm=model_type == "glm4_moe" and bool(hf.get("use_qk_norm", False)),
            gemma4=_gemma4_layers(hf) if model_type in GEMMA4_TYPES else None,
            encoder=EncoderConfig.from_dict(hf) if model_type == "bert" else None,
            vision=vision,
            **(_llama4_attention(hf) if model_type in LLAMA4_TYPES else {}),
        )


def merge_overrides(hf: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """hf with overrides merged in; an object overriding an object merges key by key (as vLLM's --hf-overrides), so
    '{"rope_scaling": {"factor": 4.0}}' changes one scaling parameter. In a multimodal config (a `text_config` inside),
    a key the top level lacks is the language model's: '{"num_hidden_layers": 2}' shortens it. Neither input is
    changed."""
    merged = dict(hf)
    text = {key: value for key, value in overrides.items() if key not in hf}
    if isinstance(hf.get("text_config"), dict) and text:
        overrides = {key: value for key, value in overrides.items() if key not in text}
        merged["text_config"] = merge_overrides(hf["text_config"], text)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_rope(hf: dict[str, Any], model_type: str, head_dim: int) -> RopeConfig:
    return _parse_rope(hf, dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {}), model_type, head_dim)


def _read_local_rope(hf: dict[str, Any], model_type: str, head_dim: int) -> RopeConfig | None:
    # transformers 5: rope_parameters["sliding_attention"]; Gemma 3's transformers 4 form: `rope_local_base_freq`
    # (the global rope_scaling does not apply to the local layers).
    params = hf.get("rope_parameters") or {}
    if isinstance(params.get("sliding_attention"), dict):
        return _parse_rope(hf, dict(params["sliding_attention"]), model_type, head_dim)
    if hf.get("rope_local_base_freq") is not None:
        return RopeConfig(theta=float(hf["rope_local_base_freq"]))
    return None


def _parse_rope(hf: dict[str, Any], params: dict[str, Any], model_type: str, head_dim: int) -> RopeConfig:
    # transformers 5: `rope_parameters` holds rope_theta and the scaling; transformers 4: top-level
    # `rope_theta` plus an optional `rope_scaling` dict whose kind is `rope_type` (or the older `type`).
    if "full_attention" in params and isinstance(params["full_attention"], dict):  # per-layer-type form
        params = dict(params["full_attention"])
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "mrope" and model_type in VISION_TYPES:  # Qwen2.5-VL's transformers 4 name: default frequencies
        # turned by mrope_section's rows
        rope_type = "default"
    if model_type == "phi3" and rope_type in ("su", "yarn"):  # Phi3Config's older names of longrope
        rope_type = "longrope"
    if rope_type == "proportional" and model_type not in GEMMA4_TYPES:
        raise ModelConfigError("unsupported rope scaling type 'proportional' for this model: Gemma 4's alone")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor") or 1.0
    if rope_type == "proportional":  # the whole head, its trailing frequencies zero (rotary.py)
        params["rope_proportion"], partial = partial, 1.0
    elif model_type in GEMMA4_TYPES:  # Gemma 4's default rope rotates whole heads whatever the factor says
        partial = 1.0
    if not 0.0 < partial <= 1.0 or int(head_dim * partial) % 2:
        raise ModelConfigError(f"partial_rotary_factor {partial} must rotate an even part of head_dim {head_dim}")
    max_positions = hf.get("max_position_embeddings", 2048)
    if rope_type in ("llama3", "yarn", "longrope"):
        # As transformers' standardize_rope_params: a top-level original_max_position_embeddings (Phi-3 keeps it
        # there; Phi3Config defaults it to 4096) wins over the scaling dict's, which defaults to the model's maximum.
        top_level = hf.get("original_max_position_embeddings") or (4096 if model_type == "phi3" else None)
        if top_level is not None:
            params["original_max_position_embeddings"] = top_level
        else:
            params.setdefault("original_max_position_embeddings", max_positions)
    missing = [key for key in _NEEDED_KEYS.get(rope_type, ()) if params.get(key) is None]
    if missing:
        raise ModelConfigError(f"rope type {rope_type!r} is missing {', '.join(missing)} in the model config")
    if rope_type == "longrope":
        num_freqs = int(head_dim * partial) // 2
        for key in ("short_factor", "long_factor"):
            if len(params[key]) != num_freqs:
                raise ModelConfigError(f"longrope {key} has {len(params[key])} values, expected {num_freqs}")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        params=params,
        partial_rotary_factor=float(partial),
        max_position_embeddings=max_positions,
    )


_NEEDED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("original_max_position_embeddings",),  # factor may be absent: max / original then
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _read_sliding_window(hf: dict[str, Any], model_type: str) -> int | None:
    # Qwen2, Qwen3 and Qwen3-MoE record a window they do not use
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
        return None
    return hf.get("sliding_window") or None


def _read_layer_windows(hf: dict[str, Any], model_type: str, window: int | None) -> tuple[int | None, ...]:
    num_layers = hf["num_hidden_layers"]
    if window is None:
        return ()
    layer_types = hf.get("layer_types")
    if layer_types is None:  # transformers 4 configs: each family's own rule
        if model_type == "gemma2":  # local, global, local, ...
            layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        elif model_type in GEMMA_TYPES:  # (pattern - 1) local layers, then a global one
            pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        elif model_type == "qwen2":  # the layers from max_window_layers on
            first = hf.get("max_window_layers", 28)  # Qwen2Config's default
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        else:
            layer_types = ["sliding_attention"] * num_layers
    layer_types = list(layer_types)[:num_layers]  # the layers a shortened model keeps (--hf-overrides)
    if len(layer_types) != num_layers:
        raise ModelConfigError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ModelConfigError(f"unsupported layer_types {sorted(unknown)}")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


# Gemma 3's published multimodal configs list only what differs from Gemma3TextConfig's defaults in text_config.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "tie_word_embeddings": True,
}
_GEMMA2_DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
}


# DeepseekV3Config's defaults for the keys that change the arithmetic (a key present as null stays null: q_lora_rank).
_DEEPSEEK_V3_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 2048,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "rope_interleave": True,
}


def _deepseek_v3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """A DeepSeek-V3 config with the reference's defaults filled in; the router the reference runs (sigmoid scores,
    grouped top-k with the correction bias), or ModelConfigError for a config that asks for another."""
    hf = {**_DEEPSEEK_V3_DEFAULTS, **hf}
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ModelConfigError(f"deepseek_v3 routes with scoring_func sigmoid and topk_method noaux_tc, not "
                               f"{hf.get('scoring_func')!r} and {hf.get('topk_method')!r}")
    if (hf.get("moe_layer_freq") or 1) != 1:
        raise ModelConfigError(f"deepseek_v3 with moe_layer_freq {hf['moe_layer_freq']} is not supported (every "
                               f"layer from first_k_dense_replace on is MoE)")
    return hf


# Glm4MoeConfig's defaults for the keys that change the arithmetic; partial_rotary_factor is the one it sets in
# __post_init__ when a config names none.
_GLM4_MOE_DEFAULTS: dict[str, Any] = {
    "partial_rotary_factor": 0.5,
    "n_shared_experts": 1,
    "n_routed_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1408,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "use_qk_norm": False,
}


def _glm4_moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """A GLM-4.5 config with the reference's defaults filled in (it routes as DeepSeek-V3 always, so there is no
    other router to refuse)."""
    return {**_GLM4_MOE_DEFAULTS, **hf}


# Gemma4TextConfig's defaults for the keys that change the arithmetic (its docstring names google/gemma-4-e2b-it)
_GEMMA4_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    },
}
_GEMMA4_LAYER_KEYS = ("head_dim", "num_key_value_heads")  # what a per_layer_config entry may set


def _gemma4_fields(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A Gemma 4 text config with Gemma4TextConfig's defaults and layer_types filled in (every sixth layer full, the
    last always full, cut to num_hidden_layers); the softmax scale is 1 (query_pre_attn_scalar 1). A multimodal
    `gemma4` config is read through its text_config: its language model (the vision and audio towers are not
    served)."""
    if model_type == "gemma4":
        hf = _language_model_config(hf, model_type)
    hf = {**_GEMMA4_TEXT_DEFAULTS, **hf}  # a key present as null stays null (hidden_size_per_layer_input: no PLE)
    if hf["rope_parameters"] is None:
        hf["rope_parameters"] = _GEMMA4_TEXT_DEFAULTS["rope_parameters"]
    if hf.get("use_bidirectional_attention") == "all":
        raise ModelConfigError("gemma4 with use_bidirectional_attention 'all' is not a causal language model")
    num_layers = hf["num_hidden_layers"]
    layer_types = list(hf.get("layer_types") or
                       ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)])
    layer_types = layer_types[:num_layers]
    if layer_types:
        layer_types[-1] = "full_attention"  # as Gemma4TextConfig forces it
    return {**hf, "layer_types": layer_types, "query_pre_attn_scalar": 1.0}


def _gemma4_layers(hf: dict[str, Any]) -> Gemma4Layers:
    """Gemma4Layers from a config _gemma4_fields completed: the full layers' heads from `per_layer_config` (as
    transformers 5 saves it) or from `global_head_dim` (default 512) and, with attention_k_eq_v,
    `num_global_key_value_heads` (as the published configs name them)."""
    num_layers, layer_types = hf["num_hidden_layers"], hf["layer_types"]
    values_are_keys = bool(hf["attention_k_eq_v"])
    per_layer = hf.get("per_layer_config")
    if per_layer is None:
        full = {"head_dim": hf.get("global_head_dim") or 512}
        if values_are_keys and hf.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = hf["num_global_key_value_heads"]
        per_layer = {i: full for i, kind in enumerate(layer_types) if kind == "full_attention"}
    per_layer = {int(i): dict(entry) for i, entry in per_layer.items()}
    unknown = {key for entry in per_layer.values() for key in entry} - set(_GEMMA4_LAYER_KEYS)
    if unknown:
        raise ModelConfigError(f"gemma4 per_layer_config sets {sorted(unknown)}; served: "
                               f"{', '.join(_GEMMA4_LAYER_KEYS)}")
    head_dims = tuple(per_layer.get(i, {}).get("head_dim", hf["head_dim"]) for i in range(num_layers))
    kv_heads = tuple(per_layer.get(i, {}).get("num_key_value_heads", hf["num_key_value_heads"])
                     for i in range(num_layers))  # fmt: skip
    first_shared = num_layers - (hf["num_kv_shared_layers"] or 0)
    kv_sources = list(range(num_layers))
    if first_shared < num_layers:  # Gemma4TextConfig.kv_sharing_modes: the last earlier layer of the same kind
        for i in range(max(first_shared, 0), num_layers):
            sources = [j for j in range(first_shared) if layer_types[j] == layer_types[i]]
            if not sources:
                raise ModelConfigError(f"gemma4 layer {i} shares the keys and values of an earlier "
                                       f"{layer_types[i]} layer, and there is none before layer {first_shared} "
                                       f"(num_kv_shared_layers {hf['num_kv_shared_layers']} of {num_layers}; with "
                                       f"fewer layers, lower num_kv_shared_layers too)")
            kv_sources[i] = sources[-1]
    double = bool(hf["use_double_wide_mlp"])
    mlp_sizes = tuple(hf["intermediate_size"] * (2 if double and kv_sources[i] != i else 1) for i in range(num_layers))
    return Gemma4Layers(
        head_dims=head_dims,
        kv_heads=kv_heads,
        values_are_keys=tuple(values_are_keys and kind == "full_attention" for kind in layer_types),
        kv_sources=tuple(kv_sources),
        mlp_sizes=mlp_sizes,
        per_layer_input_size=hf["hidden_size_per_layer_input"] or 0,
        per_layer_vocab_size=hf["vocab_size_per_layer_input"],
    )


def _gemma_fields(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A Gemma config with its family's defaults filled in; a multimodal `gemma3` config is read through its
    text_config (the language model only: loraplex serves text, the vision tower is not loaded)."""
    if model_type == "gemma2":
        return {**_GEMMA2_DEFAULTS, **hf}
    if model_type == "gemma3":
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise ModelConfigError("a gemma3 config needs its text_config (loraplex serves its language model)")
        outer = {key: hf[key] for key in ("dtype", "torch_dtype") if key in hf}
        hf = {**outer, **text, "model_type": "gemma3"}
    return {**_GEMMA3_TEXT_DEFAULTS, **hf}


# Llama4TextConfig's defaults for the keys that change the arithmetic (its class docstring names
# meta-llama/Llama-4-Scout-17B-16E as the checkpoint they describe).
_LLAMA4_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 202_048,
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16_384,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500_000.0,
    "num_experts_per_tok": 1,
    "num_local_experts": 16,
    "interleave_moe_layer_step": 1,
    "use_qk_norm": True,
    "no_rope_layer_interval": 4,
    "attention_chunk_size": 8192,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
}


def _llama4_fields(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A Llama 4 text config with Llama4TextConfig's defaults and derived lists (no_rope_layers, moe_layers,
    layer_types) filled in, each cut to num_hidden_layers (--hf-overrides may shorten the model); a multimodal
    `llama4` config is read through its text_config (its language model; the vision tower is not loaded)."""
    if model_type == "llama4":
        hf = _language_model_config(hf, model_type)
    hf = {**_LLAMA4_TEXT_DEFAULTS, **hf}
    num_layers = hf["num_hidden_layers"]
    interval, step = hf["no_rope_layer_interval"], hf["interleave_moe_layer_step"]
    no_rope = list(hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)])[:num_layers]
    moe_layers = hf.get("moe_layers")
    if moe_layers is None:
        moe_layers = range(step - 1, num_layers, step)
    layer_types = hf.get("layer_types") or ["chunked_attention" if rope else "full_attention" for rope in no_rope]
    hf = {**hf, "no_rope_layers": no_rope, "moe_layers": [i for i in moe_layers if i < num_layers],
          "layer_types": list(layer_types)[:num_layers]}
    if len(no_rope) != num_layers or len(hf["layer_types"]) != num_layers:
        raise ModelConfigError(f"no_rope_layers {no_rope} and layer_types {hf['layer_types']} must name each of "
                               f"{num_layers} layers")
    unknown = set(hf["layer_types"]) - {"chunked_attention", "full_attention"}
    if unknown:
        raise ModelConfigError(f"unsupported llama4 layer_types {sorted(unknown)}")
    if "chunked_attention" in hf["layer_types"] and not hf["attention_chunk_size"]:
        raise ModelConfigError("llama4 chunked_attention layers need attention_chunk_size")
    return hf


def _llama4_attention(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's Llama 4 attention fields from a config _llama4_fields completed."""
    chunk = hf["attention_chunk_size"]
    tuning = (float(hf["floor_scale"]), float(hf["attn_scale"])) if hf["attn_temperature_tuning"] else None
    return dict(
        layer_chunks=tuple(chunk if kind == "chunked_attention" else None for kind in hf["layer_types"]),
        nope_layers=tuple(i for i, rope in enumerate(hf["no_rope_layers"]) if not rope),
        qk_l2_norm=bool(hf["use_qk_norm"]),
        attn_temperature=tuning,
    )


def _language_model_config(hf: dict, model_type: str) -> dict:
    """A multimodal config's text_config, with the outer dtype and tie_word_embeddings where the text config leaves them
    null (transformers saves dtype null there), under the outer model_type."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ModelConfigError(f"a {model_type} config needs its text_config (loraplex serves its language model)")
    outer = {key: hf[key] for key in ("dtype", "torch_dtype", "tie_word_embeddings") if key in hf}
    return {**outer, **{key: value for key, value in text.items() if value is not None or key not in outer},
            "model_type": model_type}  # fmt: skip
