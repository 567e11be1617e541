"""Gemma 4's language model (full layers with wider heads and fewer KV heads, values that are the keys' projection,
KV-shared layers, double-wide MLPs, per-layer inputs, layer scalars, final soft-capping; MoE: a dense MLP beside
top-k experts in every layer) in the worker against HF transformers + peft in fp32: the base model and two adapters
(attention only; attention, the dense MLPs and every expert) in one batch, prompts past the sliding window; greedy
decoding, chunked prefill over a prefix-cache hit, the Triton attention backend over the cache's strided views, and
the multimodal checkpoint's language model."""

from __future__ import annotations

from pathlib import Path

import pytest
from loraplex.worker.lora.experts import LoRAExpertsLinear
from loraplex.worker.model.config import ModelConfig, ModelConfigError
from loraplex.worker.model_runner import ModelRunner

from tests.gemma4_models import (
    DENSE,
    WINDOW,
    build_gemma4_model,
    build_gemma4_set,
    build_multimodal_checkpoint,
    hf_config,
)
from tests.lora_helpers import batch_logits, greedy_decode, load_all, slot_loads, slot_of
from tests.reference import assert_greedy_matches_peft, assert_logits_match_peft, hf_logits
from tests.worker_helpers import chunked_prefill_after_a_prefix, make_runner, prefill_logits, random_prompts

KINDS = ("dense", "moe")
LOGITS_TOL = 1e-3  # fp32
MIN_ADAPTER_EFFECT = 0.1
DECODE_STEPS = 5
NAMES = [None, "a4", "a8", None, "a8"]
LENGTHS = [5, 2 * WINDOW + 3, 9, 3 * WINDOW, 13]  # several past the window
GEMMA4_LORA = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"], max_loras_per_batch=3)


@pytest.fixture(scope="module")
def gemma4_sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Path]]]:
    return {kind: build_gemma4_set(tmp_path_factory.mktemp(f"gemma4_{kind}"), kind) for kind in KINDS}


@pytest.fixture(scope="module")
def runners(gemma4_sets) -> dict[str, ModelRunner]:
    out = {}
    for kind, (model_dir, adapters) in gemma4_sets.items():
        out[kind] = make_runner(model_dir, **GEMMA4_LORA)
        load_all(out[kind], adapters)
    return out


def test_config_reads_the_layer_shapes() -> None:
    """transformers 5's saved form (per_layer_config) and the published one (global_head_dim,
    num_global_key_value_heads) read alike."""
    saved = ModelConfig.from_dict(hf_config("dense").to_dict())
    published = {**{key: value for key, value in DENSE.items()}, "model_type": "gemma4_text"}
    for config in (saved, ModelConfig.from_dict(published)):
        g4 = config.gemma4
        assert g4.head_dims == (16, 24, 16, 16, 24) and g4.kv_heads == (4, 2, 4, 4, 2)
        assert g4.kv_sources == (0, 1, 2, 2, 1) and g4.mlp_sizes == (48, 48, 48, 96, 96)
        assert g4.values_are_keys == (False, True, False, False, True) and g4.per_layer_input_size == 8
        assert config.attention_layer_ids == (0, 1, 2) and config.kv_layout(2) == (2, 2, 16)
        assert config.attention_scale == 1.0 and config.rope.rope_type == "proportional"
        assert config.layer_windows == (WINDOW, None, WINDOW, WINDOW, None)
    with pytest.raises(ModelConfigError, match="lower num_kv_shared_layers too"):
        ModelConfig.from_dict({**published, "num_hidden_layers": 2})  # 2 shared layers of 2: no source left
    moe = ModelConfig.from_dict(hf_config("moe").to_dict())
    assert (moe.moe.num_experts, moe.moe.top_k, moe.moe.shared_intermediate_size) == (4, 2, 48)


def test_layers_and_lora_buffers(runners: dict[str, ModelRunner]) -> None:
    dense = runners["dense"].model.model.layers
    assert [layer.self_attn.is_kv_shared for layer in dense] == [False, False, False, True, True]
    assert dense[1].self_attn.v_proj is None
    buffers = set(runners["dense"].lora.pool.buffers)
    assert {(0, "self_attn.v_proj"), (1, "self_attn.k_proj"), (3, "self_attn.q_proj"), (4, "mlp.down_proj")} <= buffers
    assert not {(1, "self_attn.v_proj"), (3, "self_attn.k_proj")} & buffers
    moe = runners["moe"].model.model.layers
    assert isinstance(moe[0].mlp.experts.gate_up_proj, LoRAExpertsLinear)
    assert {(2, "mlp.shared_experts.gate_up_proj"), (2, "mlp.experts.down_proj")} <= set(
        runners["moe"].lora.pool.buffers
    )


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_logits_match_peft(gemma4_sets, runners, kind: str) -> None:
    model_dir, adapters = gemma4_sets[kind]
    prompts = random_prompts(LENGTHS, runners[kind].vocab_size, seed=11)
    ours = batch_logits(runners[kind], prompts, NAMES)
    assert_logits_match_peft(ours, prompts, NAMES, model_dir, adapters, LOGITS_TOL, MIN_ADAPTER_EFFECT)


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_greedy_matches_peft(gemma4_sets, runners, kind: str) -> None:
    model_dir, adapters = gemma4_sets[kind]
    prompts = random_prompts(LENGTHS, runners[kind].vocab_size, seed=12)
    ours = greedy_decode(runners[kind], prompts, NAMES, steps=DECODE_STEPS)
    assert_greedy_matches_peft(ours, prompts, NAMES, model_dir, adapters, DECODE_STEPS)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_over_a_shared_prefix_matches_peft(gemma4_sets, runners, kind: str) -> None:
    model_dir, adapters = gemma4_sets[kind]
    prompt, num_cached, ours = chunked_prefill_after_a_prefix(runners[kind], slot_of("a8"), slot_loads(["a4", "a8"]))
    ref = hf_logits(model_dir, prompt, adapters["a8"])[num_cached:]
    diff = (ours - ref).abs().max().item()
    assert diff <= LOGITS_TOL, f"max abs logit diff {diff:.2e}"


def test_triton_attention_over_narrower_layers_matches_hf(gemma4_sets) -> None:
    """The Triton kernels (interpreted here) read the full layers' keys through strided views of the cache."""
    model_dir, _ = gemma4_sets["dense"]
    runner = make_runner(model_dir, attention_backend="triton")
    prompt = random_prompts([2 * WINDOW + 1], runner.vocab_size, seed=5)[0]
    diff = (prefill_logits(runner, prompt) - hf_logits(model_dir, prompt)).abs().max().item()
    assert diff <= LOGITS_TOL, f"max abs logit diff {diff:.2e}"


def test_multimodal_checkpoint_serves_its_language_model(gemma4_sets, tmp_path: Path) -> None:
    """A `gemma4` checkpoint (model.language_model.* beside vision and audio towers, a text_config): the text
    model's logits; the towers' tensors are skipped."""
    model_dir, _ = gemma4_sets["dense"]
    build_multimodal_checkpoint(model_dir, tmp_path / "mm")
    runner = make_runner(tmp_path / "mm")
    assert runner.model_config.model_type == "gemma4" and runner.model_config.gemma4.per_layer_input_size == 8
    prompt = random_prompts([10], runner.vocab_size, seed=3)[0]
    diff = (prefill_logits(runner, prompt) - hf_logits(model_dir, prompt)).abs().max().item()
    assert diff <= LOGITS_TOL


def test_cpu_decode_kernel_is_not_chosen_for_mixed_head_shapes() -> None:
    """The CPU decode kernel is checked for one head shape at start: a model whose layers differ runs SDPA under
    `auto` and refuses `cpu` in one line."""
    from loraplex.worker.layers.attention import AttentionBackendError, SDPAAttention, select_attention_backend

    assert ModelConfig.from_dict(hf_config("dense").to_dict()).mixed_head_shapes
    kernels = object()  # never asked: the mixed shapes decide first
    auto = select_attention_backend("auto", "cpu", 4, 4, 16, kernels, mixed_head_shapes=True)
    assert isinstance(auto, SDPAAttention)
    with pytest.raises(AttentionBackendError, match="differ in head width"):
        select_attention_backend("cpu", "cpu", 4, 4, 16, kernels, mixed_head_shapes=True)


def test_attention_biases_and_rope_variants_match_hf(tmp_path: Path) -> None:
    """q/k/v/o biases (attention_bias); a sliding layers' default rope that names a partial factor (Gemma 4's default
    rope rotates whole heads regardless); a proportional rope rotating half the pairs, slowed by a factor."""
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e6, "factor": 2.0},
    }
    model_dir = tmp_path / "gemma4_variant"
    build_gemma4_model(model_dir, "dense", attention_bias=True, rope_parameters=rope)
    runner = make_runner(model_dir)
    prompt = random_prompts([2 * WINDOW + 5], runner.vocab_size, seed=6)[0]
    diff = (prefill_logits(runner, prompt) - hf_logits(model_dir, prompt)).abs().max().item()
    assert diff <= LOGITS_TOL, f"max abs logit diff {diff:.2e}"
