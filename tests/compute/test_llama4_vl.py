"""Llama 4 with images in the worker (the vision model's tiles, pixel shuffle and projector; their rows in place of
the `<|patch|>` placeholders of the MoE decoder) against HF transformers + peft in fp32: prompts with one image, two
images (tiled, each with its global tile) and none in one batch with the base model and two language-model adapters;
a chunked prefill whose chunks cut a tile's run; greedy decoding; bad tiles refused with a BatchError; tower LoRA
(--enable-tower-connector-lora) on the vision model and projector against peft, refused without the flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loraplex.protocol.structs import ForwardBatch, ForwardReq, ImageInput
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.model_runner import ModelRunner

from tests.llama4_vision_requests import (
    LORA,
    TOWER_LORA,
    build_llama4_vl_set,
    hf_logits,
    inputs,
    request,
)
from tests.lora_helpers import load_all, slot_loads, slot_of, specs
from tests.reference import CLEAR_MARGIN, assert_greedy_match
from tests.worker_helpers import GREEDY, consecutive_pages, forward_logits, make_runner

LOGITS_TOL = 1e-3  # fp32
MIN_EFFECT = 0.1
DECODE_STEPS = 3


@pytest.fixture(scope="module")
def vl_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_llama4_vl_set(tmp_path_factory.mktemp("llama4_vl"), tower=True)


@pytest.fixture(scope="module")
def runner(vl_set) -> ModelRunner:
    model_dir, adapters = vl_set
    runner = make_runner(model_dir, **LORA)
    load_all(runner, {name: adapters[name] for name in ("a4", "a8")})
    return runner


MIXED = [("one", None), ("two", None), ("text", None), ("one", "a4"), ("two", "a8"), ("text", "a8")]


def test_mixed_batch_matches_hf_and_peft(runner, vl_set) -> None:
    """One image, two images and none, each with the base and an adapter, in one batch (a tile shared by several
    requests encoded once)."""
    model_dir, adapters = vl_set
    prompts = [inputs(key) for key, _ in MIXED]
    names = [name for _, name in MIXED]
    lengths = [p["input_ids"].shape[1] for p in prompts]
    pages = consecutive_pages(lengths, runner.page_size)
    reqs = [request(p, pg, name) for p, pg, name in zip(prompts, pages, names, strict=True)]
    before = runner.images.num_encoded
    with torch.inference_mode():
        logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=slot_loads(names)))
    assert runner.images.num_encoded - before == 1 + 6  # "one"'s tile and "two"'s six, each once
    refs = {}
    for (key, name), hf, ours in zip(MIXED, prompts, logits.split(lengths), strict=True):
        ref = refs[key, name] = hf_logits(model_dir, hf, None if name is None else adapters[name])
        diff = (ours - ref).abs().max().item()
        assert diff <= LOGITS_TOL, f"{key}/{name or 'base'}: max abs logit diff {diff:.2e}"
        if name is not None:  # MIXED has each prompt with the base first
            effect = (ref - refs[key, None]).abs().max().item()
            assert effect > MIN_EFFECT, f"{name} barely changes the logits ({effect:.3f})"
    # the images matter: the same prompt with its placeholders' own embeddings differs
    plain = request(prompts[1], pages[1])
    with torch.inference_mode():
        without = forward_logits(runner, ForwardBatch(batch_id=1, reqs=[ForwardReq(
            input_ids=plain.input_ids, num_cached_tokens=0, page_ids=pages[1], sampling=GREEDY)]))  # fmt: skip
    assert (without - logits.split(lengths)[1]).abs().max().item() > MIN_EFFECT


def test_chunked_prefill_cuts_a_tile(runner, vl_set) -> None:
    """Chunks of 3 tokens cut tiles' runs of 4: each tile encoded once (kept between the passes), every chunk's
    logits HF's rows of the whole prompt."""
    model_dir, adapters = vl_set
    hf = inputs("two")
    length = hf["input_ids"].shape[1]
    pages = consecutive_pages([length], runner.page_size)[0]
    runner.images.done.clear()
    before = runner.images.num_encoded
    chunks = []
    with torch.inference_mode():
        for batch_id, start in enumerate(range(0, length, 3)):
            req = request(hf, pages, "a8", start, min(start + 3, length))
            chunks.append(forward_logits(runner, ForwardBatch(batch_id=batch_id, reqs=[req],
                                                              slot_loads=slot_loads(["a8"]))))  # fmt: skip
    assert runner.images.num_encoded - before == 6 and not runner.images.partial
    assert any(i.offset % 3 for i in request(hf, pages).images)  # some run starts inside a chunk
    diff = (torch.cat(chunks) - hf_logits(model_dir, hf, adapters["a8"])).abs().max().item()
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
    cases = [("one", "a4"), ("two", "a8")]
    prompts = [inputs(key) for key, _ in cases]
    names = [name for _, name in cases]
    lengths = [p["input_ids"].shape[1] for p in prompts]
    pages = consecutive_pages([n + DECODE_STEPS for n in lengths], runner.page_size)
    reqs = [request(p, pg, name, key=i) for i, (p, pg, name) in enumerate(zip(prompts, pages, names, strict=True))]
    outputs = [[t] for t in runner.forward(ForwardBatch(batch_id=0, reqs=reqs, slot_loads=slot_loads(names)))]
    for step in range(1, DECODE_STEPS):
        reqs = [ForwardReq(input_ids=out[-1:], num_cached_tokens=n + step - 1, page_ids=pg, num_generated=step,
                           slot=slot_of(name), req_key=i)
                for i, (out, n, pg, name) in enumerate(zip(outputs, lengths, pages, names, strict=True))]
        for out, token in zip(outputs, runner.forward(ForwardBatch(batch_id=step, reqs=reqs)), strict=True):
            out.append(token)
    runner.forward(ForwardBatch(batch_id=DECODE_STEPS, reqs=[], released_keys=list(range(len(cases)))))
    compared = 0
    for (key, name), hf, out in zip(cases, prompts, outputs, strict=True):
        ref, margins = hf_greedy(model_dir, hf, DECODE_STEPS, None if name is None else adapters[name])
        compared += assert_greedy_match(out, ref, margins, what=f"{key}/{name or 'base'}")
    assert compared >= DECODE_STEPS * len(cases) // 2, f"only {compared} tokens had a clear margin (> {CLEAR_MARGIN})"


def test_bad_tiles_fail_the_batch(runner) -> None:
    hf = inputs("one")
    pages = consecutive_pages([hf["input_ids"].shape[1]], runner.page_size)[0]
    good = request(hf, pages)
    tile = good.images[0]
    bad = {  # what the error names -> the tile
        "shape": ImageInput(offset=tile.offset, num_tokens=tile.num_tokens, content_hash="s",
                            pixel_values=tile.pixel_values, shape=[1, 3, 8, 32]),
        "bytes": ImageInput(offset=tile.offset, num_tokens=tile.num_tokens, content_hash="b",
                            pixel_values=tile.pixel_values[:-4], shape=tile.shape),
        "placeholder tokens": ImageInput(offset=tile.offset, num_tokens=tile.num_tokens + 1, content_hash="n",
                                         pixel_values=tile.pixel_values, shape=tile.shape),
        "not its placeholder": ImageInput(offset=tile.offset - 1, num_tokens=tile.num_tokens, content_hash="p",
                                          pixel_values=tile.pixel_values, shape=tile.shape),
    }  # fmt: skip
    for what, image in bad.items():
        req = ForwardReq(input_ids=good.input_ids, num_cached_tokens=0, page_ids=pages, sampling=GREEDY,
                         images=[image])  # fmt: skip
        with pytest.raises(BatchError, match=what), torch.inference_mode():
            forward_logits(runner, ForwardBatch(batch_id=0, reqs=[req]))


@pytest.fixture(scope="module")
def tower_runner(vl_set) -> ModelRunner:
    """--enable-tower-connector-lora."""
    model_dir, adapters = vl_set
    runner = make_runner(model_dir, **TOWER_LORA)
    load_all(runner, adapters)
    return runner


TOWER_MIXED = [("two", "a16"), ("two", None), ("one", "a4"), ("text", "a16"), ("one", "a16")]


def test_tower_lora_matches_peft(tower_runner, vl_set) -> None:
    """An adapter on the vision model's attention and MLPs, the pixel-shuffle adapter and the projector (and the
    language model) beside one with none there and the base, in one batch; the tiles a16 and the base share are
    encoded once for each, and their rows differ."""
    model_dir, adapters = vl_set
    prompts = [inputs(key) for key, _ in TOWER_MIXED]
    names = [name for _, name in TOWER_MIXED]
    lengths = [p["input_ids"].shape[1] for p in prompts]
    pages = consecutive_pages(lengths, tower_runner.page_size)
    reqs = [request(p, pg, name) for p, pg, name in zip(prompts, pages, names, strict=True)]
    with torch.inference_mode():
        logits = forward_logits(tower_runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=slot_loads(names)))
        images = tower_runner.images.rows(reqs[:2])
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
