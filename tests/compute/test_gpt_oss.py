"""gpt-oss in the worker against HF transformers + peft in fp32: attention sinks, alternating sliding-window (4) and
full layers, YaRN, the biased top-k-softmax router and the experts' clamped SwiGLU with biases; the base model, an
adapter on attention alone and one on attention and every expert (PEFT's target_parameters form) in one batch,
prefill logits, greedy decoding, and chunked prefill over a prefix-cache hit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loraplex.kernels import cpu_ext
from loraplex.protocol.structs import ForwardBatch, ForwardReq
from loraplex.worker.layers.attention import CPUAttention
from loraplex.worker.layers.moe import ExpertsLinear
from loraplex.worker.lora.experts import LoRAExpertsLinear
from loraplex.worker.model_runner import ModelRunner

from tests.device_helpers import USES_GPU
from tests.gpt_oss_models import build_gpt_oss_model, build_gpt_oss_set
from tests.lora_helpers import batch_logits, greedy_decode, load_all, slot_loads, slot_of
from tests.mxfp4_checkpoint import write_mxfp4
from tests.reference import assert_greedy_matches_peft, assert_logits_match_peft, hf_logits
from tests.worker_helpers import (
    GREEDY,
    chunked_prefill_after_a_prefix,
    forward_logits,
    make_runner,
    prefill_logits,
    random_prompts,
)

LOGITS_TOL = 1e-3  # fp32; observed ~5e-5
MIN_ADAPTER_EFFECT = 0.1
DECODE_STEPS = 6
NAMES = [None, "a4", "a4", "a8", None, "a8"]  # base rows between adapters, a segment of two requests
LENGTHS = [5, 9, 3, 12, 7, 4]  # most past the window of 4
GPT_OSS_LORA = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"], max_loras_per_batch=3)


@pytest.fixture(scope="module")
def gpt_oss_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_gpt_oss_set(tmp_path_factory.mktemp("gpt_oss"))


@pytest.fixture(scope="module")
def runner(gpt_oss_set) -> ModelRunner:
    model_dir, adapters = gpt_oss_set
    runner = make_runner(model_dir, **GPT_OSS_LORA)
    load_all(runner, adapters)
    return runner


def test_the_config_is_read_as_transformers_builds_the_model(runner: ModelRunner) -> None:
    config = runner.model_config
    assert config.layer_windows == (4, None, 4) and config.attention_sinks and config.rope.rope_type == "yarn"
    assert (config.qkv_bias, config.o_bias) == (True, True)
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (4, 2, 64)
    assert (moe.swiglu_limit, moe.swiglu_alpha, moe.gate_up_interleaved) == (7.0, 1.702, True)
    for layer in runner.model.model.layers:
        assert layer.self_attn.layer.sinks is layer.self_attn.sinks
        for linear in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            assert isinstance(linear, LoRAExpertsLinear) and isinstance(linear.base, ExpertsLinear)
            assert linear.base.bias is not None
    assert runner.attention.name == "torch"


def test_mixed_batch_logits_match_peft(gpt_oss_set, runner: ModelRunner) -> None:
    model_dir, adapters = gpt_oss_set
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=11)
    ours = batch_logits(runner, prompts, NAMES)
    assert_logits_match_peft(ours, prompts, NAMES, model_dir, adapters, LOGITS_TOL, MIN_ADAPTER_EFFECT)


def test_mixed_batch_greedy_matches_peft(gpt_oss_set, runner: ModelRunner) -> None:
    model_dir, adapters = gpt_oss_set
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=12)
    ours = greedy_decode(runner, prompts, NAMES, steps=DECODE_STEPS)
    assert_greedy_matches_peft(ours, prompts, NAMES, model_dir, adapters, DECODE_STEPS)


@pytest.mark.parametrize("name", ["a4", "a8"])
def test_chunked_prefill_over_a_shared_prefix_matches_peft(gpt_oss_set, runner: ModelRunner, name: str) -> None:
    model_dir, adapters = gpt_oss_set
    prompt, num_cached, ours = chunked_prefill_after_a_prefix(runner, slot_of(name), slot_loads(["a4", "a8"]))
    ref = hf_logits(model_dir, prompt, adapters[name])[num_cached:]
    diff = (ours - ref).abs().max().item()
    assert diff <= LOGITS_TOL, f"max abs logit diff {diff:.2e}"


def test_the_sinks_take_their_share(gpt_oss_set, runner: ModelRunner) -> None:
    """Sinks pushed to -inf (no share of any softmax) change the logits: the comparisons above see them."""
    model_dir, _ = gpt_oss_set
    prompt = random_prompts([9], runner.vocab_size, seed=13)[0]
    sinks = [layer.self_attn.sinks for layer in runner.model.model.layers]
    saved = [s.clone() for s in sinks]
    try:
        for s in sinks:
            s.data.fill_(float("-inf"))
        without = batch_logits(runner, [prompt], [None])[0]
    finally:
        for s, value in zip(sinks, saved, strict=True):
            s.data.copy_(value)
    assert (without - hf_logits(model_dir, prompt)).abs().max().item() > 0.1


@pytest.mark.skipif(USES_GPU, reason="checked in the interpreter here; on a GPU the compiled kernels run everywhere")
def test_triton_attention_serves_the_sinks_as_torch_does(gpt_oss_set) -> None:
    """The Triton paged kernels (the interpreter without a GPU; their sinks variant warmed up) give the torch
    backend's logits: prefills, then decodes."""
    model_dir, adapters = gpt_oss_set
    prompts = random_prompts([6, 9], 256, seed=15)
    outputs = {}
    for backend in ("torch", "triton"):
        runner = make_runner(model_dir, **GPT_OSS_LORA, attention_backend=backend)
        assert runner.attention.name == backend and getattr(runner.attention, "sinks", True)
        load_all(runner, adapters)
        outputs[backend] = (batch_logits(runner, prompts, [None, "a8"]), greedy_decode(runner, prompts, [None, "a8"],
                                                                                      steps=3))  # fmt: skip
    for ours, ref in zip(outputs["triton"][0], outputs["torch"][0], strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-4)
    assert outputs["triton"][1] == outputs["torch"][1]


@pytest.fixture(scope="module")
def mxfp4_pair(gpt_oss_set, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The model's experts quantized to MXFP4 as the published checkpoints store them, and the same weights
    dequantized into a plain checkpoint."""
    model_dir, _ = gpt_oss_set
    root = tmp_path_factory.mktemp("mxfp4")
    write_mxfp4(model_dir, root / "mxfp4", root / "dequantized")
    return root / "mxfp4", root / "dequantized"


def test_mxfp4_experts_serve_as_their_dequantized_model(gpt_oss_set, mxfp4_pair) -> None:
    """Base and both adapters in one batch: the MXFP4 checkpoint (experts dequantized per expert at each matmul)
    equals its dequantized plain checkpoint, which equals HF + peft."""
    _, adapters = gpt_oss_set
    quant_dir, dequant_dir = mxfp4_pair
    prompts = random_prompts(LENGTHS, 256, seed=14)
    logits = {}
    for path in mxfp4_pair:
        runner = make_runner(path, **GPT_OSS_LORA)
        load_all(runner, adapters)
        logits[path] = batch_logits(runner, prompts, NAMES)
    for ours, ref in zip(logits[quant_dir], logits[dequant_dir], strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)
    assert_logits_match_peft(logits[quant_dir], prompts, NAMES, dequant_dir, adapters, LOGITS_TOL, MIN_ADAPTER_EFFECT)


def test_mxfp4_experts_stay_packed(mxfp4_pair) -> None:
    """The experts hold codes and scales (4.25 bits per weight), no float weight; 17/128 of fp32's bytes."""
    quant_dir, dequant_dir = mxfp4_pair
    quant, plain = make_runner(quant_dir), make_runner(dequant_dir)
    for ours, theirs in zip(quant.model.model.layers, plain.model.model.layers, strict=True):
        for name in ("gate_up_proj", "down_proj"):
            packed, full = getattr(ours.mlp.experts, name), getattr(theirs.mlp.experts, name)
            assert packed.packed and not hasattr(packed, "weight") and packed.blocks.dtype == torch.uint8
            assert packed.resident_bytes * 128 == full.resident_bytes * 17  # (1/2 + 1/32) bytes against 4
    assert not quant.model.model.layers[0].self_attn.qkv_proj.quant  # attention stays plain


@pytest.mark.skipif(USES_GPU, reason="checked in the interpreter here; on a GPU the Triton path is the one chosen")
def test_mxfp4_experts_through_the_triton_matmul_equal_the_torch_path(mxfp4_pair) -> None:
    """The CUDA path's choice (kernels/mxfp4_matmul.py, codes decoded inside the tiles; the interpreter here), made
    on the CPU-built experts: the base model's logits equal the torch path's, which dequantizes whole experts."""
    quant_dir, _ = mxfp4_pair
    runner = make_runner(quant_dir)
    prompts = random_prompts([7, 12], 256, seed=16)
    experts = [m for m in runner.model.modules() if isinstance(m, ExpertsLinear)]
    assert experts and all(m.packed and not m.mxfp4_triton for m in experts)  # the CPU's choice
    torch_path = batch_logits(runner, prompts, [None, None])
    for module in experts:
        module.mxfp4_triton = True
    triton_path = batch_logits(runner, prompts, [None, None])
    for ours, ref in zip(triton_path, torch_path, strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)


class _CountingKernels:
    """cpu_ext's module, counting its decode attention calls."""

    def __init__(self, module):
        self.module, self.decode_calls = module, 0

    def __getattr__(self, name: str):
        return getattr(self.module, name)

    def decode_attention(self, *args) -> None:
        self.decode_calls += 1
        self.module.decode_attention(*args)


@pytest.mark.skipif(cpu_ext.unavailable_reason() is not None, reason="the CPU kernels cannot run here")
def test_bfloat16_cpu_decode_runs_the_sinks_in_the_kernel(tmp_path: Path) -> None:
    """bfloat16 on a CPU with the compiled kernels (head_dim 64: the `cpu` attention backend): every layer's decode,
    sliding (window 4) and full, with its sinks, runs in the kernel; the step's logits equal the same token's in a
    whole prefill, and HF's fp32 logits within bfloat16's rounding."""
    model_dir = tmp_path / "gpt_oss_hd64"
    build_gpt_oss_model(model_dir, head_dim=64)
    runner = make_runner(model_dir, dtype="bfloat16")
    assert type(runner.attention) is CPUAttention
    counting = runner.attention.compiled = _CountingKernels(runner.attention.compiled)
    prompt = random_prompts([10], runner.vocab_size, seed=17)[0]  # the last token at 9: past the window
    whole = prefill_logits(runner, prompt)[-1].float()
    pages = list(range(3))
    first = ForwardReq(input_ids=prompt[:9], num_cached_tokens=0, page_ids=pages, sampling=GREEDY, slot=-1)
    runner.forward(ForwardBatch(batch_id=0, reqs=[first]))
    step = ForwardReq(input_ids=prompt[9:], num_cached_tokens=9, page_ids=pages, sampling=GREEDY, slot=-1)
    calls = counting.decode_calls
    decoded = forward_logits(runner, ForwardBatch(batch_id=1, reqs=[step]))[-1].float()
    assert counting.decode_calls - calls == runner.model_config.num_layers  # every layer's decode, in the kernel
    ref = hf_logits(model_dir, prompt)[-1]
    scale = ref.abs().max().item()
    assert (decoded - whole).abs().max().item() <= 0.02 * scale
    assert (decoded - ref).abs().max().item() <= 0.05 * scale
