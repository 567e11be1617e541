"""GLM-4.5 (GQA attention with q/k/v biases, partial rotary and per-head q/k norms; DeepSeek-V3's grouped sigmoid
router, shared experts and a dense first layer) in the worker against HF transformers (+ peft) in fp32: the base model
and two adapters in one batch, one on attention alone (peft's reference) and one on attention, every routed expert,
the shared experts and the dense MLP (HF with the adapter merged into its weights: peft on transformers 5 drops the
shared experts' terms); prefill logits, greedy decoding, chunked prefill over a prefix-cache hit; a config without
qk norms; PEFT's target_parameters form over the stacked experts; a checkpoint's MTP layer skipped; and GLM-4.5-Air's
widths with dummy weights."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model_runner import ModelRunner

from tests.expert_adapters import merged_reference
from tests.glm4_moe_models import build_glm4_moe_set, hf_config
from tests.lora_helpers import batch_logits, greedy_decode, load_all, slot_loads, slot_of
from tests.reference import assert_greedy_match, greedy_with_margins, hf_logits, hf_model
from tests.worker_helpers import chunked_prefill_after_a_prefix, make_runner, prefill_logits, random_prompts

LOGITS_TOL = 1e-3  # fp32
MIN_ADAPTER_EFFECT = 0.1
DECODE_STEPS = 6
NAMES = [None, "a4", "a4", "a8", None, "a8"]  # base rows between adapters, a segment of two requests
LENGTHS = [5, 9, 3, 12, 7, 4]
GLM_LORA = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"], max_loras_per_batch=3)


@pytest.fixture(scope="module")
def glm_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_glm4_moe_set(tmp_path_factory.mktemp("glm4_moe"))


@pytest.fixture(scope="module")
def runner(glm_set) -> ModelRunner:
    model_dir, adapters = glm_set
    runner = make_runner(model_dir, **GLM_LORA)
    load_all(runner, adapters)
    return runner


@pytest.fixture(scope="module")
def references(glm_set):
    """name -> HF's model: the base, peft's on a4, the merged weights of a8."""
    model_dir, adapters = glm_set
    merged = functools.lru_cache(maxsize=None)(lambda: merged_reference(model_dir, adapters["a8"]))
    return lambda name: {
        None: lambda: hf_model(str(model_dir)),
        "a4": lambda: hf_model(str(model_dir), str(adapters["a4"])),
        "a8": merged,
    }[name]()


def ref_logits(references, name: str | None, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return references(name)(torch.tensor([prompt])).logits[0]  # (len, vocab)


def test_config_reads_glm_fields(runner: ModelRunner) -> None:
    config = runner.model_config
    assert (config.qkv_bias, config.o_bias, config.qk_norm, config.head_dim) == (True, False, True, 16)
    assert config.rope.rotary_dim(config.head_dim) == 8
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.num_groups, moe.topk_group, moe.dense_layers) == (8, 3, 4, 2, (0,))
    assert (moe.routed_scaling_factor, moe.shared_intermediate_size, moe.renormalize) == (2.5, 32, True)
    buffers = set(runner.lora.pool.buffers)
    assert {
        (0, "self_attn.qkv_proj"),
        (0, "mlp.gate_up_proj"),
        (1, "mlp.experts.gate_up_proj"),
        (1, "mlp.shared_experts.gate_up_proj"),
        (1, "mlp.shared_experts.down_proj"),
    } <= buffers


def test_partial_rotary_default_is_the_references() -> None:
    """A config naming no partial_rotary_factor rotates half of each head, as Glm4MoeConfig fills it in."""
    hf = hf_config().to_dict()
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    config = ModelConfig.from_dict(hf)
    assert config.rope.partial_rotary_factor == 0.5 and not ModelConfig.from_dict({**hf, "use_qk_norm": False}).qk_norm


def test_mixed_batch_logits_match_the_references(runner: ModelRunner, references) -> None:
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=11)
    ours = batch_logits(runner, prompts, NAMES)
    for prompt, name, logits in zip(prompts, NAMES, ours, strict=True):
        ref = ref_logits(references, name, prompt)
        diff = (logits - ref).abs().max().item()
        assert diff <= LOGITS_TOL, f"{name or 'base'}: max abs logit diff {diff:.2e}"
        if name is not None:
            effect = (ref - ref_logits(references, None, prompt)).abs().max().item()
            assert effect > MIN_ADAPTER_EFFECT, f"{name} barely changes the logits ({effect:.3f})"


def test_shared_experts_terms_are_served(runner: ModelRunner, references) -> None:
    """Without the shared experts' LoRA terms a8's logits leave the merged reference: they are in it."""
    prompt = random_prompts([8], runner.vocab_size, seed=9)[0]
    shared = runner.lora.pool.buffers[(1, "mlp.shared_experts.down_proj")]
    saved = shared.lora_b.clone()
    shared.lora_b.zero_()
    try:
        without = batch_logits(runner, [prompt], ["a8"])[0]
    finally:
        shared.lora_b.copy_(saved)
    assert (without - ref_logits(references, "a8", prompt)).abs().max().item() > MIN_ADAPTER_EFFECT


def test_mixed_batch_greedy_matches_the_references(runner: ModelRunner, references) -> None:
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=12)
    ours = greedy_decode(runner, prompts, NAMES, steps=DECODE_STEPS)
    num_compared = 0
    for prompt, name, out in zip(prompts, NAMES, ours, strict=True):
        ref, margins = greedy_with_margins(references(name), prompt, DECODE_STEPS)
        num_compared += assert_greedy_match(out, ref, margins, what=name or "base")
    assert num_compared >= DECODE_STEPS * len(prompts) // 2, f"only {num_compared} tokens had a clear margin"


@pytest.mark.parametrize("name", ["a4", "a8"])
def test_chunked_prefill_over_a_shared_prefix_matches(runner: ModelRunner, references, name: str) -> None:
    prompt, num_cached, ours = chunked_prefill_after_a_prefix(runner, slot_of(name), slot_loads(["a4", "a8"]))
    ref = ref_logits(references, name, prompt)[num_cached:]
    diff = (ours - ref).abs().max().item()
    assert diff <= LOGITS_TOL, f"max abs logit diff {diff:.2e}"


def test_without_qk_norm_and_attention_bias_matches_hf(tmp_path: Path) -> None:
    """GLM-4.5-Air's attention form (no q/k norms); attention_bias off too, routed_scaling_factor 1, one group."""
    model_dir, adapters = build_glm4_moe_set(
        tmp_path, use_qk_norm=False, attention_bias=False, routed_scaling_factor=1.0, n_group=1, topk_group=1
    )
    runner = make_runner(model_dir, **GLM_LORA)
    load_all(runner, {"a4": adapters["a4"]})
    attn = runner.model.model.layers[1].self_attn
    assert not hasattr(attn, "q_norm") and attn.qkv_proj.base.bias is None
    prompts = random_prompts([6, 10], runner.vocab_size, seed=7)
    for prompt, name, logits in zip(prompts, ["a4", None], batch_logits(runner, prompts, ["a4", None]), strict=True):
        with torch.inference_mode():
            ref = hf_model(str(model_dir), None if name is None else str(adapters[name]))(torch.tensor([prompt]))
        assert (logits - ref.logits[0]).abs().max().item() <= LOGITS_TOL, name


def test_dummy_weights_at_glm_4_5_air_widths_with_fewer_layers_and_experts(tmp_path: Path) -> None:
    """--load-format dummy on Glm4MoeConfig's defaults (46 layers, hidden 4096, 96 q / 8 KV heads, 128 experts of
    1408, top 8, one shared expert, the first layer dense) with GLM-4.5-Air's head_dim 128 and q/k/v biases, the
    layers, experts and widths cut as --hf-overrides cuts them: the model builds, draws every parameter (the router's
    float32 correction bias included) and decodes finite logits."""
    from transformers import Glm4MoeConfig

    model_dir = tmp_path / "air"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(Glm4MoeConfig(head_dim=128, attention_bias=True).to_dict()))
    overrides = {
        "num_hidden_layers": 2,
        "n_routed_experts": 8,
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    }
    runner = make_runner(model_dir, load_format="dummy", hf_overrides=overrides)
    config = runner.model_config
    assert (config.head_dim, config.rope.rotary_dim(128), config.qkv_bias, config.o_bias) == (128, 64, True, False)
    assert runner.kv_bytes_per_token == 2 * 2 * 2 * 128 * 4  # layers, k and v, KV heads, head_dim, fp32
    bias = runner.model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0
    assert torch.isfinite(prefill_logits(runner, [1, 2, 3, 4, 5])).all()


def test_the_multi_token_prediction_layer_is_skipped_at_load(glm_set, runner: ModelRunner, tmp_path: Path) -> None:
    """Published GLM-4.5 checkpoints carry one MTP layer after the decoder's (model.layers.<num_hidden_layers>.*,
    which HF's model ignores too): the model loads without it and computes as before."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir, _ = glm_set
    with_mtp = tmp_path / "with_mtp"
    shutil.copytree(model_dir, with_mtp)
    weights = load_file(with_mtp / "model.safetensors")
    hidden = runner.model_config.hidden_size
    weights |= {"model.layers.2.eh_proj.weight": torch.ones(hidden, 2 * hidden),
                "model.layers.2.enorm.weight": torch.ones(hidden),
                "model.layers.2.self_attn.q_proj.weight": torch.ones(64, hidden)}  # fmt: skip
    save_file(weights, with_mtp / "model.safetensors", metadata={"format": "pt"})
    prompt = random_prompts([7], runner.vocab_size, seed=3)[0]
    ours = prefill_logits(make_runner(with_mtp), prompt)
    with torch.inference_mode():
        ref = hf_model(str(model_dir))(torch.tensor([prompt])).logits[0]
    assert (ours - ref).abs().max().item() <= LOGITS_TOL


def test_peft_target_parameters_adapter_matches_peft(glm_set, runner: ModelRunner, references, tmp_path: Path) -> None:
    """PEFT's other expert form, `target_parameters` over the stacked experts (with attention), built and read back
    by peft itself, in one batch with the base model and the per-expert a8."""
    from tests.glm4_moe_models import ATTENTION
    from tests.moe_models import build_parameter_adapter

    model_dir, adapters = glm_set
    a16 = tmp_path / "a16"
    build_parameter_adapter(model_dir, a16, r=8, lora_alpha=16, target_modules=ATTENTION, seed=3)
    load_all(runner, {"a16": a16})
    prompts = random_prompts([6, 9, 5], runner.vocab_size, seed=13)
    names = ["a16", None, "a8"]
    for prompt, name, logits in zip(prompts, names, batch_logits(runner, prompts, names), strict=True):
        ref = hf_logits(model_dir, prompt, a16) if name == "a16" else ref_logits(references, name, prompt)
        assert (logits - ref).abs().max().item() <= LOGITS_TOL, name
    assert (hf_logits(model_dir, prompts[0], a16) - hf_logits(model_dir, prompts[0])).abs().max() > MIN_ADAPTER_EFFECT
