"""Gemma 4 with images in the worker (vision tower, pooled soft tokens in place of the placeholder tokens, their
per-layer inputs the pad token's) against HF transformers + peft in fp32: prompts with one image, two images of
different shapes and none in one batch with the base model and two language-model adapters; a chunked prefill whose
chunks cut an image's run; greedy decoding; adapters on the vision tower and its embedder
(--enable-tower-connector-lora) beside ones without, and refused without the flag; image tokens that attend both
ways (use_bidirectional_attention "vision"), with a prefix hit inside a run, and a pass cutting one refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loraplex.protocol.structs import ForwardBatch, ForwardReq
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.model_runner import ModelRunner

from tests.gemma4_vision_models import (
    LORA,
    TOWER_LORA,
    build_gemma4_vl,
    build_gemma4_vl_set,
    hf_logits,
    inputs,
    request,
)
from tests.lora_helpers import load_all, slot_loads, slot_of, specs
from tests.reference import CLEAR_MARGIN, assert_greedy_match
from tests.worker_helpers import GREEDY, consecutive_pages, forward_logits, make_runner

LOGITS_TOL = 1e-3  # fp32 (two images: ~5e-4 through the tower and five layers of std 0.3)
MIN_EFFECT = 0.1
DECODE_STEPS = 3


@pytest.fixture(scope="module")
def vl_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_gemma4_vl_set(tmp_path_factory.mktemp("gemma4_vl"), tower=True)


@pytest.fixture(scope="module")
def runner(vl_set) -> ModelRunner:
    model_dir, adapters = vl_set
    runner = make_runner(model_dir, **LORA)
    load_all(runner, {name: adapters[name] for name in ("a4", "a8")})
    return runner


MIXED = [("one", None), ("two", None), ("text", None), ("one", "a4"), ("two", "a8"), ("text", "a8")]


def test_mixed_batch_matches_hf_and_peft(runner, vl_set) -> None:
    """One image, two images and none, each with the base and an adapter, in one batch (the same image in several
    requests, encoded once); the images matter (their placeholders' own embeddings give other logits)."""
    model_dir, adapters = vl_set
    prompts = [inputs(key) for key, _ in MIXED]
    names = [name for _, name in MIXED]
    lengths = [p["input_ids"].shape[1] for p in prompts]
    pages = consecutive_pages(lengths, runner.page_size)
    reqs = [request(p, pg, name) for p, pg, name in zip(prompts, pages, names, strict=True)]
    with torch.inference_mode():
        logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=slot_loads(names)))
    for (key, name), hf, ours in zip(MIXED, prompts, logits.split(lengths), strict=True):
        ref = hf_logits(model_dir, hf, None if name is None else adapters[name])
        diff = (ours - ref).abs().max().item()
        assert diff <= LOGITS_TOL, f"{key}/{name or 'base'}: max abs logit diff {diff:.2e}"
        if name is not None:
            effect = (ref - hf_logits(model_dir, hf)).abs().max().item()
            assert effect > MIN_EFFECT, f"{name} barely changes the logits ({effect:.3f})"
    with torch.inference_mode():
        without = forward_logits(runner, ForwardBatch(batch_id=1, reqs=[ForwardReq(
            input_ids=reqs[0].input_ids, num_cached_tokens=0, page_ids=pages[0], sampling=GREEDY)]))  # fmt: skip
    assert (without - logits.split(lengths)[0]).abs().max().item() > MIN_EFFECT


def test_chunked_prefill_cuts_an_image(runner, vl_set) -> None:
    """Chunks of 40 tokens cut both images' runs (64 and 60 soft tokens); each image is encoded once, its rows kept
    for the passes after; every chunk's logits equal HF's rows of the whole prompt."""
    model_dir, adapters = vl_set
    hf = inputs("two")
    length = hf["input_ids"].shape[1]
    pages = consecutive_pages([length], runner.page_size)[0]
    runner.images.done.clear()  # the earlier test's images (the same ones) are kept
    before = runner.images.num_encoded
    chunks = []
    with torch.inference_mode():
        for batch_id, start in enumerate(range(0, length, 40)):
            req = request(hf, pages, "a4", start, min(start + 40, length))
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
    model_dir, adapters = vl_set
    cases = [("two", "a8"), ("text", None)]
    prompts = [inputs(key) for key, _ in cases]
    names = [name for _, name in cases]
    lengths = [p["input_ids"].shape[1] for p in prompts]
    pages = consecutive_pages([n + DECODE_STEPS for n in lengths], runner.page_size)
    reqs = [request(p, pg, name, key=i) for i, (p, pg, name) in enumerate(zip(prompts, pages, names, strict=True))]
    outputs = [[t] for t in runner.forward(ForwardBatch(batch_id=0, reqs=reqs, slot_loads=slot_loads(names)))]
    for step in range(1, DECODE_STEPS):
        reqs = [ForwardReq(input_ids=out[-1:], num_cached_tokens=n + step - 1, page_ids=pg, num_generated=step,
                           slot=slot_of(name), req_key=i, sampling=GREEDY)
                for i, (out, n, pg, name) in enumerate(zip(outputs, lengths, pages, names, strict=True))]
        for out, token in zip(outputs, runner.forward(ForwardBatch(batch_id=step, reqs=reqs)), strict=True):
            out.append(token)
    runner.forward(ForwardBatch(batch_id=DECODE_STEPS, reqs=[], released_keys=list(range(len(cases)))))
    compared = 0
    for (key, name), hf, out in zip(cases, prompts, outputs, strict=True):
        ref, margins = hf_greedy(model_dir, hf, DECODE_STEPS, None if name is None else adapters[name])
        compared += assert_greedy_match(out, ref, margins, what=f"{key}/{name or 'base'}")
    assert compared >= DECODE_STEPS * len(cases) // 2, f"only {compared} tokens had a clear margin (> {CLEAR_MARGIN})"


TOWER_MIXED = [("one", "a16"), ("one", None), ("two", "a4"), ("text", "a16"), ("two", "a16")]


def test_tower_lora_matches_peft(vl_set) -> None:
    """--enable-tower-connector-lora: an adapter on the tower's linears and the embedder's projection (and the
    language model) beside one with none there and the base, in one batch; the image a16 and the base share is
    encoded once for each, and its rows differ."""
    model_dir, adapters = vl_set
    runner = make_runner(model_dir, **TOWER_LORA)
    load_all(runner, adapters)
    prompts = [inputs(key) for key, _ in TOWER_MIXED]
    names = [name for _, name in TOWER_MIXED]
    lengths = [p["input_ids"].shape[1] for p in prompts]
    pages = consecutive_pages(lengths, runner.page_size)
    reqs = [request(p, pg, name) for p, pg, name in zip(prompts, pages, names, strict=True)]
    with torch.inference_mode():
        logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=slot_loads(names)))
        images = runner.images.rows(reqs[:2])
    for (key, name), hf, ours in zip(TOWER_MIXED, prompts, logits.split(lengths), strict=True):
        ref = hf_logits(model_dir, hf, None if name is None else adapters[name])
        diff = (ours - ref).abs().max().item()
        assert diff <= LOGITS_TOL, f"{key}/{name or 'base'}: max abs logit diff {diff:.2e}"
    with_adapter, base = images.embeds.split(len(images.rows) // 2)
    assert (with_adapter - base).abs().max().item() > MIN_EFFECT  # the tower's adapter moved the rows


def test_tower_adapter_refused_without_the_flag(runner, vl_set) -> None:
    _, adapters = vl_set
    (outcome,) = runner.lora.load(specs({"a16": adapters["a16"]}, {"a16": 3}))
    assert not outcome.success and "--enable-tower-connector-lora" in outcome.error_message, outcome


def test_image_tokens_that_attend_both_ways_match_hf(tmp_path: Path) -> None:
    """use_bidirectional_attention "vision": on the sliding layers (window 8) an image's tokens see its later ones.
    One image, two and none in one batch; a request whose prefix hit ends inside a run (its rest in the pass); a
    pass that ends inside a run is refused."""
    model_dir = tmp_path / "bidirectional"
    build_gemma4_vl(model_dir, use_bidirectional_attention="vision")
    runner = make_runner(model_dir)
    assert runner.model_config.vision.bidirectional
    prompts = [inputs(key) for key in ("one", "two", "text")]
    lengths = [p["input_ids"].shape[1] for p in prompts]
    pages = consecutive_pages(lengths, runner.page_size)
    reqs = [request(p, pg, key=i) for i, (p, pg) in enumerate(zip(prompts, pages, strict=True))]
    with torch.inference_mode():
        logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs))
        for hf, ours in zip(prompts, logits.split(lengths), strict=True):
            diff = (ours - hf_logits(model_dir, hf)).abs().max().item()
            assert diff <= LOGITS_TOL, f"max abs logit diff {diff:.2e}"
        [image] = reqs[0].images
        hit = image.offset + image.num_tokens // 2  # the first request's pages hold the keys before it
        rest = forward_logits(runner, ForwardBatch(batch_id=1, reqs=[request(prompts[0], pages[0], start=hit, key=5)]))
        diff = (rest - hf_logits(model_dir, prompts[0])[hit:]).abs().max().item()
        assert diff <= LOGITS_TOL, f"hit inside the run: max abs logit diff {diff:.2e}"
        cut = request(prompts[0], pages[0], end=image.offset + 3, key=6)
        with pytest.raises(BatchError, match="ends inside the image run"):
            forward_logits(runner, ForwardBatch(batch_id=2, reqs=[cut]))
    causal = hf_logits(model_dir, {**prompts[0], "mm_token_type_ids": torch.zeros_like(prompts[0]["input_ids"])})
    assert (causal - logits.split(lengths)[0]).abs().max().item() > MIN_EFFECT  # both ways differs from causal


def test_clipped_and_standardized_tower_matches_hf(tmp_path: Path) -> None:
    """use_clipped_linears (each tower linear's input and output clamped to the checkpoint's bounds) and standardize
    (the pooled soft tokens' std_bias and std_scale): the tower's and embedder's rows equal HF's get_image_features."""
    from loraplex.worker.images import _pixels
    from transformers import Gemma4ForConditionalGeneration

    from tests.gemma4_vision_models import hf_config, image_inputs, make_image_processor, make_tokenizer

    config = hf_config()
    config.vision_config.use_clipped_linears, config.vision_config.standardize = True, True
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
        for name, buffer in model.named_buffers():
            if name.endswith(("_min", "_max")):  # tight enough that the clamps bite
                buffer.fill_(0.3 if name.endswith("_max") else -0.3)
            elif name.endswith("std_bias") or name.endswith("std_scale"):
                buffer.copy_(torch.rand(buffer.shape) + 0.5)
    model.save_pretrained(tmp_path)
    make_tokenizer().save_pretrained(tmp_path)
    make_image_processor().save_pretrained(tmp_path)
    runner = make_runner(tmp_path)
    hf = inputs("two")
    images = image_inputs(hf)
    with torch.inference_mode():
        ref = torch.cat(model.model.get_image_features(hf["pixel_values"], hf["image_position_ids"]).pooler_output)
        ours = runner.model.encode_images(torch.cat([_pixels(i) for i in images]), [i.grid_thw for i in images])
        unclipped = model.model.vision_tower.encoder.layers[0].self_attn.q_proj
        unclipped.use_clipped_linears = False  # the bounds matter: without them the rows differ
        loose = torch.cat(model.model.get_image_features(hf["pixel_values"], hf["image_position_ids"]).pooler_output)
    assert (ours - ref).abs().max().item() <= 1e-3 * ref.abs().max().item()
    assert (loose - ref).abs().max().item() > MIN_EFFECT
