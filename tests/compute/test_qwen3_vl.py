"""Qwen3-VL in the worker (a Qwen3 decoder with interleaved M-RoPE, deepstack rows added after its first layers, a
vision tower with learned positions and deepstack mergers) against HF transformers + peft in fp32: prompts with one
image, two images and none in one batch with the base model and two language-model adapters; a chunked prefill whose
chunks cut both images' runs (each image's row and deepstack rows kept between passes); greedy decoding; the M-RoPE
positions of protocol/mrope.py against HF's get_rope_index; LoRA on the tower, its mergers and deepstack mergers
(--enable-tower-connector-lora) mixed with an adapter without, and refused without the flag. Qwen3-VL-MoE
(Qwen3-MoE's layers) likewise on a mixed batch, its stacked experts loading in the published (experts, in, out)
layout too."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from loraplex.protocol.mrope import mrope_positions
from loraplex.protocol.structs import ForwardBatch, ForwardReq
from loraplex.worker.model_runner import ModelRunner

from tests.lora_helpers import load_all, slot_loads, slot_of, specs
from tests.qwen3_vl_models import (
    MERGE,
    TOWER_ADAPTERS,
    VISION,
    build_qwen3_vl,
    build_qwen3_vl_moe,
    make_image_processor,
)
from tests.reference import CLEAR_MARGIN, assert_greedy_match
from tests.vision_requests import (
    LORA,
    TOWER_LORA,
    build_vl_adapter,
    build_vl_set,
    hf_logits,
    hf_vl,
    image_token_id,
    request,
)
from tests.vision_requests import inputs as vl_inputs
from tests.worker_helpers import consecutive_pages, forward_logits, make_runner

LOGITS_TOL = 2e-4  # fp32, logits ~10 in magnitude
MIN_EFFECT = 0.1
DECODE_STEPS = 4
NUM_DEEPSTACK = len(VISION["deepstack_visual_indexes"])


def inputs(key: str) -> dict:
    return vl_inputs(key, make_image_processor())


@pytest.fixture(scope="module")
def vl_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_vl_set(tmp_path_factory.mktemp("qwen3_vl"), tower=True, build=build_qwen3_vl,
                        tower_adapters=TOWER_ADAPTERS)  # fmt: skip


@pytest.fixture(scope="module")
def runner(vl_set) -> ModelRunner:
    model_dir, adapters = vl_set
    runner = make_runner(model_dir, **LORA)
    load_all(runner, {name: adapters[name] for name in ("a4", "a8")})
    return runner


def run_batch(runner: ModelRunner, cases: list[tuple[str, str | None]]) -> tuple[list[dict], list[torch.Tensor]]:
    prompts = [inputs(key) for key, _ in cases]
    names = [name for _, name in cases]
    lengths = [p["input_ids"].shape[1] for p in prompts]
    pages = consecutive_pages(lengths, runner.page_size)
    reqs = [request(p, pg, name) for p, pg, name in zip(prompts, pages, names, strict=True)]
    with torch.inference_mode():
        logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=slot_loads(names)))
    return prompts, list(logits.split(lengths))


def assert_matches(model_dir: Path, adapters: dict[str, Path], cases, prompts, logits) -> None:
    for (key, name), hf, ours in zip(cases, prompts, logits, strict=True):
        ref = hf_logits(model_dir, hf, None if name is None else adapters[name])
        diff = (ours - ref).abs().max().item()
        assert diff <= LOGITS_TOL, f"{key}/{name or 'base'}: max abs logit diff {diff:.2e}"
        if name is not None:
            effect = (ref - hf_logits(model_dir, hf)).abs().max().item()
            assert effect > MIN_EFFECT, f"{name} barely changes the logits ({effect:.3f})"


MIXED = [("one", None), ("two", None), ("text", None), ("one", "a4"), ("two", "a8"), ("text", "a8")]


def test_mixed_batch_matches_hf_and_peft(runner, vl_set) -> None:
    """One image, two images and none, each with the base and an adapter, in one batch; each image's rows carry its
    deepstack rows, and without them (the placeholders' rows only) the logits differ."""
    model_dir, adapters = vl_set
    prompts, logits = run_batch(runner, MIXED)
    assert_matches(model_dir, adapters, MIXED, prompts, logits)
    hf = prompts[0]
    req = request(hf, consecutive_pages([hf["input_ids"].shape[1]], runner.page_size)[0])
    runner.images.done.clear()
    with torch.inference_mode():
        images = runner.images.rows([req])
        assert images.embeds.shape[1:] == (1 + NUM_DEEPSTACK, 64)  # (rows, placeholder + deepstack, hidden)
        deepstack = images.embeds[:, 1:]
        no_deepstack = images.embeds.clone()
        no_deepstack[:, 1:] = 0
        runner.images.done[next(iter(runner.images.done))] = no_deepstack
        without = forward_logits(runner, ForwardBatch(batch_id=1, reqs=[req]))
    runner.images.done.clear()
    assert deepstack.abs().max().item() > 0.1
    assert (without - logits[0]).abs().max().item() > MIN_EFFECT  # deepstack changes the answer


def test_chunked_prefill_cuts_the_images(runner, vl_set) -> None:
    """Chunks of 7 tokens cut both images' runs (16 and 24 placeholders): each image is encoded once, its rows and
    deepstack rows kept for the later chunks, and every chunk's logits equal HF's rows of the whole prompt."""
    model_dir, adapters = vl_set
    hf = inputs("two")
    length = hf["input_ids"].shape[1]
    pages = consecutive_pages([length], runner.page_size)[0]
    runner.images.done.clear()
    before = runner.images.num_encoded
    chunks = []
    with torch.inference_mode():
        for batch_id, start in enumerate(range(0, length, 7)):
            req = request(hf, pages, "a4", start, min(start + 7, length))
            chunks.append(forward_logits(runner, ForwardBatch(batch_id=batch_id, reqs=[req],
                                                              slot_loads=slot_loads(["a4"]))))  # fmt: skip
    assert runner.images.num_encoded - before == 2 and not runner.images.partial
    diff = (torch.cat(chunks) - hf_logits(model_dir, hf, adapters["a4"])).abs().max().item()
    assert diff <= LOGITS_TOL, f"chunked prefill: max abs logit diff {diff:.2e}"


@torch.inference_mode()
def hf_greedy(model_dir: Path, hf: dict, steps: int, adapter_dir: Path | None) -> tuple[list[int], list[float]]:
    out, margins = [], []
    for _ in range(steps):
        top2 = torch.topk(hf_logits(model_dir, hf, adapter_dir, extra=out)[-1], 2)
        out.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
    return out, margins


def test_greedy_decode_matches_hf(runner, vl_set) -> None:
    """Prefill then decode (the decode passes carry mrope_delta, no rows), one image, two with an adapter, none."""
    model_dir, adapters = vl_set
    cases = [("one", None), ("two", "a8"), ("text", "a4")]
    prompts = [inputs(key) for key, _ in cases]
    names = [name for _, name in cases]
    lengths = [p["input_ids"].shape[1] for p in prompts]
    pages = consecutive_pages([n + DECODE_STEPS for n in lengths], runner.page_size)
    reqs = [request(p, pg, name, key=i) for i, (p, pg, name) in enumerate(zip(prompts, pages, names, strict=True))]
    outputs = [[t] for t in runner.forward(ForwardBatch(batch_id=0, reqs=reqs, slot_loads=slot_loads(names)))]
    for step in range(1, DECODE_STEPS):
        steps = [ForwardReq(input_ids=out[-1:], num_cached_tokens=n + step - 1, page_ids=pg, num_generated=step,
                            slot=slot_of(name), req_key=i, mrope_delta=req.mrope_delta)
                 for i, (out, n, pg, name, req) in enumerate(zip(outputs, lengths, pages, names, reqs, strict=True))]
        for out, token in zip(outputs, runner.forward(ForwardBatch(batch_id=step, reqs=steps)), strict=True):
            out.append(token)
    runner.forward(ForwardBatch(batch_id=DECODE_STEPS, reqs=[], released_keys=list(range(len(cases)))))
    compared = 0
    for (key, name), hf, out in zip(cases, prompts, outputs, strict=True):
        ref, margins = hf_greedy(model_dir, hf, DECODE_STEPS, None if name is None else adapters[name])
        compared += assert_greedy_match(out, ref, margins, what=f"{key}/{name or 'base'}")
    assert compared >= DECODE_STEPS * len(cases) // 2, f"only {compared} tokens had a clear margin (> {CLEAR_MARGIN})"


def test_mrope_positions_match_hf_get_rope_index(vl_set) -> None:
    model_dir, _ = vl_set
    model = hf_vl(str(model_dir))
    for key in ("one", "two"):
        hf = inputs(key)
        ids = hf["input_ids"][0].tolist()
        rows, delta = mrope_positions(ids, image_token_id(), hf["image_grid_thw"].tolist(), MERGE)
        ref, ref_delta = model.model.get_rope_index(hf["input_ids"], mm_token_type_ids=hf["mm_token_type_ids"],
                                                    image_grid_thw=hf["image_grid_thw"])  # fmt: skip
        assert rows == ref[:, 0].tolist() and delta == int(ref_delta[0]), key


TOWER_MIXED = [("one", "a16"), ("one", None), ("two", "a4"), ("text", "a16"), ("two", "a16")]


def test_tower_lora_matches_peft_and_needs_the_flag(runner, vl_set) -> None:
    """--enable-tower-connector-lora: an adapter on the tower's attention and MLP, its merger and deepstack mergers
    (and the language model) beside one with none there and the base, in one batch; without the flag it is refused
    by name."""
    model_dir, adapters = vl_set
    tower_runner = make_runner(model_dir, **TOWER_LORA)
    load_all(tower_runner, adapters)
    prompts, logits = run_batch(tower_runner, TOWER_MIXED)
    assert_matches(model_dir, adapters, TOWER_MIXED, prompts, logits)
    (outcome,) = runner.lora.load(specs({"a16": adapters["a16"]}, {"a16": 3}))
    assert not outcome.success and "--enable-tower-connector-lora" in outcome.error_message, outcome


@pytest.fixture(scope="module")
def moe_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("qwen3_vl_moe")
    build_qwen3_vl_moe(root / "base")
    build_vl_adapter(root / "base", root / "a4", 4, 8, ("q_proj", "v_proj"), seed=0,
                     target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
    return root / "base", {"a4": root / "a4"}


def test_moe_matches_hf_and_peft_in_both_expert_layouts(moe_set, tmp_path: Path) -> None:
    """qwen3_vl_moe: one image, two with an adapter (on attention and, by PEFT's target_parameters, the stacked
    experts), none, in one batch; then the same checkpoint with its stacked experts transposed to the published
    (experts, in, out) layout serves the same logits."""
    from safetensors.torch import load_file, save_file

    model_dir, adapters = moe_set
    runner = make_runner(model_dir, **dict(LORA, lora_target_modules=["all"]))
    load_all(runner, adapters)
    cases = [("one", None), ("two", "a4"), ("text", None)]
    prompts, logits = run_batch(runner, cases)
    assert_matches(model_dir, adapters, cases, prompts, logits)
    published = tmp_path / "published"
    shutil.copytree(model_dir, published)
    tensors = load_file(published / "model.safetensors")
    stacked = [key for key in tensors if key.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert stacked
    save_file({key: t.transpose(1, 2).contiguous() if key in stacked else t for key, t in tensors.items()},
              published / "model.safetensors")  # fmt: skip
    _, again = run_batch(make_runner(published), cases[:1])
    diff = (again[0] - hf_logits(model_dir, prompts[0])).abs().max().item()
    assert diff <= LOGITS_TOL, f"(experts, in, out) checkpoint: max abs logit diff {diff:.2e}"
