"""DeepSeek-V3 (latent attention, grouped sigmoid router, shared experts, a dense first layer, yarn with mscale,
interleaved rope) in the worker against HF transformers + peft in fp32: the base model and two adapters on every
latent-attention linear (kv_b_proj included) and the experts (both PEFT forms) in one batch, and two adapters split
between attention and experts; prefill logits (the expanded form, and equal to the absorbed form), greedy decoding
(the absorbed form), one batch of decodes and prefills, chunked prefill over a prefix-cache hit, a recompute after
preemption; and the cache's bytes per token."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq
from loraplex.worker.kv_cache import kv_bytes_per_token
from loraplex.worker.layers.attention import AttentionInputs, BatchPart
from loraplex.worker.lora.latent import LoRALatentKVProj
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.deepseek_v3 import LatentKVProj
from loraplex.worker.model_runner import ModelRunner

from tests.lora_helpers import (
    ADAPTER_IDS,
    batch_logits,
    build_peft_adapter,
    greedy_decode,
    load_all,
    mixed_prefill_decode_logits,
    slot_loads,
    slot_of,
)
from tests.mla_models import MLA_TARGETS, build_mla_set, hf_config
from tests.moe_models import build_parameter_adapter
from tests.reference import (
    assert_greedy_match,
    assert_greedy_matches_peft,
    assert_logits_match_peft,
    hf_greedy,
    hf_logits,
    hf_model,
)
from tests.worker_helpers import (
    GREEDY,
    chunked_prefill_after_a_prefix,
    make_runner,
    random_prompts,
)

LOGITS_TOL = 1e-3  # fp32; observed ~2e-5
MIN_ADAPTER_EFFECT = 0.1
DECODE_STEPS = 6
NAMES = [None, "a4", "a4", "a8", None, "a8"]  # base rows between adapters, a segment of two requests
LENGTHS = [5, 9, 3, 12, 7, 4]
MLA_LORA = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"], max_loras_per_batch=3)


@pytest.fixture(scope="module")
def mla_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_mla_set(tmp_path_factory.mktemp("mla"))


@pytest.fixture(scope="module")
def runner(mla_set) -> ModelRunner:
    model_dir, adapters = mla_set
    runner = make_runner(model_dir, **MLA_LORA)
    load_all(runner, adapters)
    return runner


@pytest.fixture(scope="module")
def split_set(mla_set, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """The model of mla_set with two adapters split between the layer kinds: "a4" on every latent-attention linear
    alone (kv_b_proj included; PEFT's own), "a8" on the stacked experts alone (target_parameters)."""
    model_dir, _ = mla_set
    root = tmp_path_factory.mktemp("mla_split")
    adapters = {"a4": root / "attention", "a8": root / "experts"}
    build_peft_adapter(model_dir, adapters["a4"], r=8, lora_alpha=16, target_modules=MLA_TARGETS, seed=7)
    build_parameter_adapter(model_dir, adapters["a8"], r=4, lora_alpha=8, target_modules=(), seed=8)
    return model_dir, adapters


@pytest.fixture(scope="module")
def split_runner(split_set) -> ModelRunner:
    model_dir, adapters = split_set
    runner = make_runner(model_dir, **MLA_LORA)
    load_all(runner, adapters)
    return runner


@pytest.fixture(params=["every_linear", "split"])
def adapter_case(request: pytest.FixtureRequest) -> tuple[ModelRunner, Path, dict[str, Path]]:
    """(runner, model_dir, adapters): a4 and a8 on every linear, or split between attention and experts."""
    runner_name, set_name = ("runner", "mla_set") if request.param == "every_linear" else ("split_runner", "split_set")
    model_dir, adapters = request.getfixturevalue(set_name)
    return request.getfixturevalue(runner_name), model_dir, adapters


@pytest.fixture
def form_rows(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """The rows kv_b_proj takes in each form, summed over layers: "expand" (the expanded form's context latents) and
    "absorb_query" (the absorbed form's queries)."""
    rows: Counter = Counter()

    def counted(name: str):
        original = getattr(LatentKVProj, name)

        def method(self, x: torch.Tensor, owners):
            rows[name] += x.shape[0]
            return original(self, x, owners)

        return method

    for name in ("expand", "absorb_query"):
        monkeypatch.setattr(LatentKVProj, name, counted(name))
    return rows


def absorb_every_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, a batch of one kind runs every request in the absorbed form, prefills too."""

    def parts(self: AttentionInputs) -> tuple[BatchPart, None]:
        (group,) = self.groups
        return BatchPart(self, group, is_whole=True), None

    monkeypatch.setattr(AttentionInputs, "decodes_and_prefills", parts)


def test_cache_holds_the_latent_and_rope_key(runner: ModelRunner) -> None:
    mla = runner.model_config.mla
    assert tuple(runner.kv_cache.kv.shape[1:2]) == (1,) and runner.kv_cache.kv.shape[-2:] == (1, 32 + 8)
    assert runner.kv_bytes_per_token == 2 * (32 + 8) * 4  # two layers, fp32
    assert mla.softmax_scale > (16 + 8) ** -0.5  # yarn's mscale_all_dim raises it
    attn = runner.model.model.layers[1].self_attn
    assert isinstance(attn.kv_b_proj, LoRALatentKVProj)
    assert {"mlp.experts.gate_up_proj", "self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"} <= {
        name for _, name in runner.lora.pool.buffers
    }


def test_latent_kv_bytes_per_token_against_plain_attention() -> None:
    """The figure of docs/MODELS.md: DeepSeek-V3's published shapes, bf16, one rank, every layer."""
    published = dict(
        num_hidden_layers=61,
        num_attention_heads=128,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    )
    config = ModelConfig.from_dict(hf_config(**published).to_dict())
    parts, heads, head_dim = config.kv_layout(1)
    latent = kv_bytes_per_token(61, heads, head_dim, torch.bfloat16, parts)
    # the same model with plain multi-head attention: keys of qk_head_dim and values of v_head_dim, 128 heads
    plain = 61 * 128 * ((128 + 64) + 128) * 2
    print(
        f"\nDeepSeek-V3 KV bytes per token (bf16, 61 layers): latent {latent}, plain MHA {plain}, "
        f"{plain / latent:.1f}x smaller"
    )
    assert latent == 61 * (512 + 64) * 2 == 70_272
    assert plain / latent > 50


def test_mixed_batch_logits_match_peft(mla_set, runner: ModelRunner) -> None:
    model_dir, adapters = mla_set
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=11)
    ours = batch_logits(runner, prompts, NAMES)
    assert_logits_match_peft(ours, prompts, NAMES, model_dir, adapters, LOGITS_TOL, MIN_ADAPTER_EFFECT)


def test_prefills_run_the_expanded_form_equal_to_the_absorbed_form(
    adapter_case, form_rows: Counter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of prefills (base and two adapters) expands its context latents and never absorbs; forced through the
    absorbed form instead, its logits are the same within fp32 rounding."""
    runner, _, _ = adapter_case
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=13)
    expanded = batch_logits(runner, prompts, NAMES)
    assert form_rows["expand"] > 0 and form_rows["absorb_query"] == 0, form_rows
    form_rows.clear()
    absorb_every_request(monkeypatch)
    absorbed = batch_logits(runner, prompts, NAMES)
    assert form_rows["expand"] == 0 and form_rows["absorb_query"] == 2 * sum(LENGTHS), form_rows
    for name, ours, ref in zip(NAMES, expanded, absorbed, strict=True):
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-4, f"{name}: expanded vs absorbed max abs logit diff {diff:.2e}"


def test_split_adapters_match_peft(split_set, split_runner: ModelRunner) -> None:
    """An adapter on the attention alone (kv_b_proj included) and one on the experts alone, beside the base model."""
    model_dir, adapters = split_set
    prompts = random_prompts(LENGTHS, split_runner.vocab_size, seed=14)
    ours = batch_logits(split_runner, prompts, NAMES)
    assert_logits_match_peft(ours, prompts, NAMES, model_dir, adapters, LOGITS_TOL, MIN_ADAPTER_EFFECT)


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_kv_b_proj_adapter_enters_either_form(
    mla_set, runner: ModelRunner, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With kv_b_proj's adapter terms left out, a8's logits move away from PEFT's: the expanded form's keys and
    values carry them, and so do the absorbed form's query and value products."""
    model_dir, adapters = mla_set
    if form == "absorbed":
        absorb_every_request(monkeypatch)
    prompt = random_prompts([9], runner.vocab_size, seed=5)[0]
    ref = hf_logits(model_dir, prompt, adapters["a8"])
    with_term = batch_logits(runner, [prompt], ["a8"])[0]
    for layer in runner.model.model.layers:
        monkeypatch.setattr(layer.self_attn.kv_b_proj, "_runs", lambda owners: iter(()))
    without = batch_logits(runner, [prompt], ["a8"])[0]
    assert (with_term - ref).abs().max().item() <= LOGITS_TOL
    assert (without - ref).abs().max().item() > MIN_ADAPTER_EFFECT


def test_mixed_prefill_and_decode_batch_matches_peft(adapter_case, form_rows: Counter) -> None:
    """The decodes run absorbed and the prefills expanded in one forward, each equal to HF + peft."""
    runner, model_dir, adapters = adapter_case
    sequences, cached, names, ours = mixed_prefill_decode_logits(runner)
    assert form_rows["absorb_query"] == 2 * 3, form_rows  # the mixed batch's three decodes, in both layers
    for seq, n, name, logits in zip(sequences, cached, names, ours, strict=True):
        ref = hf_logits(model_dir, seq, None if name is None else adapters[name])[n:]
        diff = (logits - ref).abs().max().item()
        assert diff <= LOGITS_TOL, f"{name or 'base'} ({len(seq) - n} new after {n}): max abs logit diff {diff:.2e}"


def test_mixed_batch_greedy_matches_peft(mla_set, runner: ModelRunner) -> None:
    model_dir, adapters = mla_set
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=12)
    ours = greedy_decode(runner, prompts, NAMES, steps=DECODE_STEPS)
    assert_greedy_matches_peft(ours, prompts, NAMES, model_dir, adapters, DECODE_STEPS)


def test_chunked_prefill_over_a_shared_prefix_matches_peft(mla_set, runner: ModelRunner, form_rows: Counter) -> None:
    """Chunks of 5, 5 and 1 tokens over 8 cached ones: the first two expand the prefix hit's latents with theirs."""
    model_dir, adapters = mla_set
    prompt, num_cached, ours = chunked_prefill_after_a_prefix(runner, slot_of("a8"), slot_loads(["a4", "a8"]))
    # per layer: request A's 11 tokens expanded (12, padded to whole pages), the chunks' contexts of 13 and 18 (16,
    # 20), the last chunk's one token absorbed
    assert form_rows == {"expand": 2 * (12 + 16 + 20), "absorb_query": 2 * 1}, form_rows
    ref = hf_logits(model_dir, prompt, adapters["a8"])[num_cached:]
    diff = (ours - ref).abs().max().item()
    assert diff <= LOGITS_TOL, f"max abs logit diff {diff:.2e}"


def test_recompute_after_preemption_matches_peft(mla_set, runner: ModelRunner) -> None:
    # A preempted request loses its pages and comes back as one prefill of its prompt and the tokens it had made,
    # into other pages (the old ones overwritten meanwhile by another request); its decoding then goes on.
    model_dir, adapters = mla_set
    prompt = random_prompts([7], runner.vocab_size, seed=21)[0]
    slot = slot_of("a4")
    loads = slot_loads(["a4", "a8"])

    def run(tokens: list[int], pages: list[int], steps: int, loads=()) -> list[int]:
        out: list[int] = []
        req = ForwardReq(input_ids=tokens, num_cached_tokens=0, page_ids=pages, sampling=GREEDY, slot=slot)
        for step in range(steps):
            out += runner.forward(ForwardBatch(batch_id=step, reqs=[req], slot_loads=list(loads) if step == 0 else []))
            req = ForwardReq(input_ids=out[-1:], num_cached_tokens=len(tokens) + step, page_ids=pages, sampling=GREEDY,
                             slot=slot)  # fmt: skip
        return out

    first = run(prompt, [80, 81, 82, 83], 3, loads)
    run(random_prompts([12], runner.vocab_size, seed=22)[0], [80, 81, 82], 1)  # another request takes the pages
    second = run(prompt + first, [90, 91, 92, 93], 3)
    ref, margins = hf_greedy(model_dir, prompt, 6, adapters["a4"])
    assert assert_greedy_match(first + second, ref, margins, "preempted") >= 3


def test_plain_q_proj_model_with_lora_matches_peft(tmp_path: Path) -> None:
    """q_lora_rank null (a plain q_proj per head, as DeepSeek-V2-Lite): LoRA on q_proj and the latent linears."""
    from tests.mla_models import build_mla_model
    from tests.moe_models import build_parameter_adapter

    model_dir, adapter_dir = tmp_path / "plain_q", tmp_path / "plain_q-a8"
    build_mla_model(model_dir, q_lora_rank=None, rope_interleave=False)
    build_parameter_adapter(
        model_dir,
        adapter_dir,
        r=8,
        lora_alpha=16,
        seed=3,
        target_modules=("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
    )
    runner = make_runner(model_dir, **MLA_LORA)
    results = runner.lora.load([AdapterToLoad(lora_name="a8", lora_path=str(adapter_dir), lora_id=ADAPTER_IDS["a8"])])
    assert all(r.success for r in results), [r.error_message for r in results]
    assert "self_attn.q_proj" in {name for _, name in runner.lora.pool.buffers}
    prompts = random_prompts([6, 10], runner.vocab_size, seed=7)
    for prompt, name, logits in zip(prompts, ["a8", None], batch_logits(runner, prompts, ["a8", None]), strict=True):
        ref = hf_logits(model_dir, prompt, None if name is None else adapter_dir)
        assert (logits - ref).abs().max().item() <= LOGITS_TOL, name


def test_shared_experts_and_dense_mlp_adapter_matches_merged_weights(tmp_path: Path) -> None:
    """An adapter on DeepSeek's own per-expert modules also holds the dense layers' MLP and the shared experts'
    (`mlp.shared_experts.gate_proj`): served, it equals HF's model with every product merged into the weights."""
    from tests.expert_adapters import merged_reference
    from tests.mla_models import build_mla_expert_adapter, build_mla_model

    model_dir, adapter_dir = tmp_path / "model", tmp_path / "mlps"
    build_mla_model(model_dir)
    build_mla_expert_adapter(model_dir, adapter_dir, r=4, lora_alpha=8, seed=4, with_mlps=True)
    runner = make_runner(model_dir, **MLA_LORA)
    results = runner.lora.load([AdapterToLoad(lora_name="a4", lora_path=str(adapter_dir), lora_id=ADAPTER_IDS["a4"])])
    assert all(r.success for r in results), [r.error_message for r in results]
    assert {
        (0, "mlp.gate_up_proj"),
        (1, "mlp.shared_experts.gate_up_proj"),
        (1, "mlp.shared_experts.down_proj"),
        (1, "mlp.experts.gate_up_proj"),
    } <= set(runner.lora.pool.buffers)
    merged = merged_reference(model_dir, adapter_dir)
    prompts = random_prompts([8, 5], runner.vocab_size, seed=9)
    for prompt, name, logits in zip(prompts, ["a4", None], batch_logits(runner, prompts, ["a4", None]), strict=True):
        with torch.inference_mode():
            ref = (merged if name else hf_model(str(model_dir)))(torch.tensor([prompt])).logits[0]
        assert (logits - ref).abs().max().item() <= LOGITS_TOL, name
    # the shared experts' terms are in it: without them the served logits leave the merged reference
    shared = runner.lora.pool.buffers[(1, "mlp.shared_experts.down_proj")]
    saved = shared.lora_b.clone()
    shared.lora_b.zero_()
    try:
        without = batch_logits(runner, prompts[:1], ["a4"])[0]
    finally:
        shared.lora_b.copy_(saved)
    with torch.inference_mode():
        assert (without - merged(torch.tensor([prompts[0]])).logits[0]).abs().max().item() > MIN_ADAPTER_EFFECT


def test_dummy_weights_at_published_widths_with_fewer_layers_and_experts(tmp_path: Path) -> None:
    """--load-format dummy on DeepseekV3Config's defaults (DeepSeek-V3's widths, heads, ranks and yarn-free rope)
    with the layers, experts and vocabulary cut by overrides as --hf-overrides cuts them: the model builds, draws
    every parameter (the router's float32 correction bias included) and decodes finite logits."""
    import json

    from transformers import DeepseekV3Config

    from tests.worker_helpers import prefill_logits

    model_dir = tmp_path / "dsv3"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(DeepseekV3Config().to_dict()))
    overrides = {
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "vocab_size": 512,
        "hidden_size": 512,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_attention_heads": 8,
    }
    runner = make_runner(model_dir, load_format="dummy", hf_overrides=overrides)
    mla = runner.model_config.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim) == (
        1536,
        512,
        64,
        128,
        128,
    )
    assert runner.kv_bytes_per_token == 2 * (512 + 64) * 4
    bias = runner.model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0
    logits = prefill_logits(runner, [1, 2, 3, 4, 5])
    assert torch.isfinite(logits).all()


def test_bfloat16_on_the_cpu_keeps_kv_b_proj_plain(mla_set, runner: ModelRunner) -> None:
    """bfloat16 on a CPU prepacks the linears for oneDNN (worker/layers/packed.py); kv_b_proj, read per head in the
    absorbed form, stays plain, and the bfloat16 model decodes as the fp32 one within bfloat16's rounding."""
    model_dir, _ = mla_set
    bf16 = make_runner(model_dir, dtype="bfloat16", lora_backend="torch")
    kv_b = bf16.model.model.layers[0].self_attn.kv_b_proj
    assert kv_b.weight.numel() == kv_b.weight.shape[0] * kv_b.weight.shape[1] > 0 and kv_b.packed_weight is None
    prompt = random_prompts([9], runner.vocab_size, seed=6)[0]
    ours = batch_logits(bf16, [prompt], [None])[0].float()
    ref = hf_logits(model_dir, prompt, None)
    assert (ours - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
