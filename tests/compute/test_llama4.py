"""Llama 4's language model (chunked local attention on its RoPE layers, NoPE global layers with temperature tuning,
QK L2 norm, interleaved rotary, sigmoid top-1 experts fed their routing weight, a shared expert, dense layers
between) in the worker against HF transformers + peft in fp32: the base model and two adapters (attention only;
attention, MLPs, shared experts and the stacked experts) in one batch, prompts across several chunks; greedy
decoding, chunked prefill over a prefix-cache hit, the multimodal checkpoint's language model, and a start at
Llama4TextConfig's default widths with dummy weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from loraplex.kernels import cpu_ext
from loraplex.protocol.structs import ForwardBatch, ForwardReq
from loraplex.worker.layers.attention import CPUAttention, select_attention_backend
from loraplex.worker.layers.moe import ExpertsLinear
from loraplex.worker.layers.triton_attention import TritonAttention
from loraplex.worker.lora.experts import LoRAExpertsLinear
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model_runner import ModelRunner

from tests.llama4_models import build_llama4_model, build_llama4_set, build_multimodal_checkpoint, hf_config
from tests.lora_helpers import batch_logits, greedy_decode, load_all, slot_loads, slot_of
from tests.reference import assert_greedy_matches_peft, assert_logits_match_peft, hf_logits
from tests.worker_helpers import (
    GREEDY,
    chunked_prefill_after_a_prefix,
    consecutive_pages,
    forward_logits,
    make_runner,
    prefill_logits,
    random_prompts,
)

LOGITS_TOL = 1e-3  # fp32
MIN_ADAPTER_EFFECT = 0.1
DECODE_STEPS = 6
NAMES = [None, "a4", "a4", "a8", None, "a8"]  # base rows between adapters, a segment of two requests
LENGTHS = [5, 9, 3, 14, 7, 13]  # chunks of 6: most prompts cross one or two chunk boundaries
LLAMA4_LORA = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"], max_loras_per_batch=3)


@pytest.fixture(scope="module")
def llama4_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_llama4_set(tmp_path_factory.mktemp("llama4"))


@pytest.fixture(scope="module")
def runner(llama4_set) -> ModelRunner:
    model_dir, adapters = llama4_set
    runner = make_runner(model_dir, **LLAMA4_LORA)
    load_all(runner, adapters)
    return runner


def test_config_reads_the_layer_kinds() -> None:
    config = ModelConfig.from_dict(hf_config().to_dict())
    assert config.layer_chunks == (6, None, 6, 6) and config.nope_layers == (1,)
    assert config.moe.dense_layers == (0, 2) and config.intermediate_size == 96 and config.moe.intermediate_size == 48
    assert config.moe.shared_intermediate_size == 48 and config.qk_l2_norm and config.attn_temperature == (4.0, 0.5)
    # the NoPE layer reads every key: the scheduler must free no page behind the chunks
    assert config.attention_window is None


def test_layers_and_lora_buffers(runner: ModelRunner) -> None:
    layers = runner.model.model.layers
    assert [layer.self_attn.rotary is None for layer in layers] == [False, True, False, False]
    for layer_id in (1, 3):
        experts = layers[layer_id].mlp.experts
        assert isinstance(experts.gate_up_proj, LoRAExpertsLinear) and isinstance(
            experts.gate_up_proj.base, ExpertsLinear
        )
    assert {
        (0, "mlp.gate_up_proj"),
        (1, "mlp.shared_experts.gate_up_proj"),
        (3, "mlp.shared_experts.down_proj"),
        (1, "mlp.experts.gate_up_proj"),
        (3, "mlp.experts.down_proj"),
    } <= set(runner.lora.pool.buffers)


def test_mixed_batch_logits_match_peft(llama4_set, runner: ModelRunner) -> None:
    model_dir, adapters = llama4_set
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=11)
    ours = batch_logits(runner, prompts, NAMES)
    assert_logits_match_peft(ours, prompts, NAMES, model_dir, adapters, LOGITS_TOL, MIN_ADAPTER_EFFECT)


def test_mixed_batch_greedy_matches_peft(llama4_set, runner: ModelRunner) -> None:
    model_dir, adapters = llama4_set
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=12)
    ours = greedy_decode(runner, prompts, NAMES, steps=DECODE_STEPS)
    assert_greedy_matches_peft(ours, prompts, NAMES, model_dir, adapters, DECODE_STEPS)


def test_chunked_prefill_over_a_shared_prefix_matches_peft(llama4_set, runner: ModelRunner) -> None:
    model_dir, adapters = llama4_set
    prompt, num_cached, ours = chunked_prefill_after_a_prefix(runner, slot_of("a8"), slot_loads(["a4", "a8"]))
    ref = hf_logits(model_dir, prompt, adapters["a8"])[num_cached:]
    diff = (ours - ref).abs().max().item()
    assert diff <= LOGITS_TOL, f"max abs logit diff {diff:.2e}"


def test_multimodal_checkpoint_serves_its_language_model(llama4_set, tmp_path: Path) -> None:
    """A `llama4` checkpoint (language_model.* beside a vision model and projector, a text_config): the text model's
    logits for a prompt without images."""
    model_dir, _ = llama4_set
    build_multimodal_checkpoint(model_dir, tmp_path / "mm")
    runner = make_runner(tmp_path / "mm")
    assert runner.model_config.model_type == "llama4" and runner.model_config.nope_layers == (1,)
    prompt = random_prompts([10], runner.vocab_size, seed=3)[0]
    diff = (prefill_logits(runner, prompt) - hf_logits(model_dir, prompt)).abs().max().item()
    assert diff <= LOGITS_TOL


def test_triton_attention_backend_matches_torch(llama4_set) -> None:
    """--attention-backend triton (the paged kernels mask the chunks; Triton's interpreter here): prefills that cross
    chunk boundaries, then decode steps across more of them, in one batch; logits equal the torch backend's."""
    model_dir, _ = llama4_set
    assert isinstance(select_attention_backend("auto", "cuda", 4, 2, 16), TritonAttention)
    lengths, steps = [5, 12, 11], 2  # chunks of 6: decodes at 5-6 (across a boundary), 12-13 (at one), 11-12
    logits = {}
    for backend in ("triton", "torch"):
        runner = make_runner(model_dir, attention_backend=backend)
        assert runner.attention.name == backend
        prompts = random_prompts(lengths, runner.vocab_size, seed=21)
        pages = consecutive_pages([n + steps for n in lengths], runner.page_size)
        reqs = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=-1)
                for p, pg in zip(prompts, pages, strict=True)]  # fmt: skip
        outs = [forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs))]
        for step in range(steps):
            reqs = [ForwardReq(input_ids=[(7 * step + i) % runner.vocab_size], num_cached_tokens=n + step,
                               page_ids=pg, sampling=GREEDY, slot=-1)
                    for i, (n, pg) in enumerate(zip(lengths, pages, strict=True))]  # fmt: skip
            outs.append(forward_logits(runner, ForwardBatch(batch_id=step + 1, reqs=reqs)))
        logits[backend] = torch.cat(outs)
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)


def test_dummy_weights_at_default_widths_with_fewer_layers_and_experts(tmp_path: Path) -> None:
    """--load-format dummy on Llama4TextConfig's defaults (its docstring names meta-llama/Llama-4-Scout-17B-16E:
    hidden 5120, 40 heads of 128, 8 KV heads, chunks of 8192, a NoPE layer every fourth) with the layers, experts,
    vocabulary and MLP widths cut by overrides as --hf-overrides cuts them: the model builds, draws every parameter
    and decodes finite logits."""
    from transformers import Llama4TextConfig

    model_dir = tmp_path / "scout"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(Llama4TextConfig().to_dict()))
    overrides = {
        "num_hidden_layers": 4,
        "num_local_experts": 2,
        "vocab_size": 512,
        "intermediate_size": 128,
        "intermediate_size_mlp": 256,
    }
    runner = make_runner(model_dir, load_format="dummy", hf_overrides=overrides)
    config = runner.model_config
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (5120, 40, 8, 128)
    assert config.layer_chunks == (8192, 8192, 8192, None) and config.nope_layers == (3,)
    assert config.moe.dense_layers == () and config.rope.theta == 500_000.0
    shared = runner.model.model.layers[0].mlp.shared_experts.down_proj.weight
    assert shared.abs().sum() > 0
    logits = prefill_logits(runner, [1, 2, 3, 4, 5])
    assert torch.isfinite(logits).all()


@pytest.mark.skipif(cpu_ext.unavailable_reason() is not None, reason="the CPU kernels cannot run here")
def test_bfloat16_cpu_decode_keeps_the_chunks(tmp_path: Path) -> None:
    """bfloat16 on a CPU with the compiled kernels (head_dim 64: the `cpu` attention backend): a decode step's
    logits, the chunked layers' decodes in the kernel (which reads only the token's chunk), equal the same token's in
    a whole prefill, and HF's fp32 logits within bfloat16's rounding."""
    model_dir = tmp_path / "llama4_hd64"
    build_llama4_model(model_dir, head_dim=64, hidden_size=128)
    runner = make_runner(model_dir, dtype="bfloat16")
    assert type(runner.attention) is CPUAttention
    prompt = random_prompts([10], runner.vocab_size, seed=4)[0]  # the last token at 9, in the chunk [6, 12)
    whole = prefill_logits(runner, prompt)[-1].float()
    pages = list(range(3))
    first = ForwardReq(input_ids=prompt[:9], num_cached_tokens=0, page_ids=pages, sampling=GREEDY, slot=-1)
    runner.forward(ForwardBatch(batch_id=0, reqs=[first]))
    step = ForwardReq(input_ids=prompt[9:], num_cached_tokens=9, page_ids=pages, sampling=GREEDY, slot=-1)
    decoded = forward_logits(runner, ForwardBatch(batch_id=1, reqs=[step]))[-1].float()
    ref = hf_logits(model_dir, prompt)[-1]
    scale = ref.abs().max().item()
    assert (decoded - whole).abs().max().item() <= 0.02 * scale
    assert (decoded - ref).abs().max().item() <= 0.05 * scale


def test_checkpoint_names_of_the_renamed_modules() -> None:
    """What the quantized-coverage check reads: our `mlp.*` modules under the checkpoint's `feed_forward.*` names."""
    from loraplex.worker.loader import checkpoint_module_names
    from loraplex.worker.model.registry import build_model

    with torch.device("meta"):
        model = build_model(ModelConfig.from_dict(hf_config().to_dict()), max_positions=64)
    assert checkpoint_module_names(model, "model.layers.1.mlp.shared_experts.gate_up_proj")[1][:2] == [
        "model.layers.1.feed_forward.shared_expert.up_proj",
        "language_model.model.layers.1.feed_forward.shared_expert.up_proj",
    ]
    assert checkpoint_module_names(model, "model.layers.0.mlp.down_proj") == [
        ["model.layers.0.feed_forward.down_proj", "language_model.model.layers.0.feed_forward.down_proj"]
    ]


def test_llama3_scaled_rope_matches_hf(tmp_path: Path) -> None:
    """Rope scaling `llama3` (the kind Llama 4's published configs use), rotated as complex pairs: the base model's
    logits equal HF's over a prompt across several chunks."""
    model_dir = tmp_path / "llama4_llama3_rope"
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64)  # fmt: skip
    build_llama4_model(model_dir, rope_parameters=rope)
    runner = make_runner(model_dir)
    assert runner.model_config.rope.rope_type == "llama3"
    prompt = random_prompts([17], runner.vocab_size, seed=8)[0]
    diff = (prefill_logits(runner, prompt) - hf_logits(model_dir, prompt)).abs().max().item()
    assert diff <= LOGITS_TOL, f"max abs logit diff {diff:.2e}"


def test_every_layer_moe_top2_without_qk_norm_matches_hf(tmp_path: Path) -> None:
    """The other switches: every layer MoE (interleave_moe_layer_step 1), no QK norm, two experts per token (each
    fed the token scaled by its own weight), no temperature tuning."""
    model_dir = tmp_path / "llama4_variant"
    build_llama4_model(model_dir, interleave_moe_layer_step=1, use_qk_norm=False, num_experts_per_tok=2,
                       attn_temperature_tuning=False)  # fmt: skip
    runner = make_runner(model_dir)
    assert runner.model_config.moe.dense_layers == () and not runner.model_config.qk_l2_norm
    prompt = random_prompts([15], runner.vocab_size, seed=9)[0]
    diff = (prefill_logits(runner, prompt) - hf_logits(model_dir, prompt)).abs().max().item()
    assert diff <= LOGITS_TOL, f"max abs logit diff {diff:.2e}"
