"""Gemma 3 with images in the worker (SigLIP tower, pooled projector, image rows in place of the soft tokens, each
image's soft tokens attending both ways in prefill, sliding-window layers narrower than an image) against HF
transformers + peft in fp32: one image, two and none in one batch with the base and two language-model adapters; a
chunked prefill whose chunks the scheduler keeps off an image's run; a prefix hit inside one; greedy decoding; a pass
that would cut a run refused; the triton backend's image passes on torch attention; an adapter on the tower
(--enable-tower-connector-lora) beside one without, equal to peft, and refused by the flag's name without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loraplex.protocol.structs import ForwardBatch, ForwardReq
from loraplex.scheduler.image_runs import whole_image_len
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.model_runner import ModelRunner

from tests.gemma3_vl_models import LORA, TOWER_LORA, build_set, hf_logits, hf_model, inputs, request
from tests.lora_helpers import load_all, slot_loads, slot_of, specs
from tests.reference import CLEAR_MARGIN, assert_greedy_match
from tests.worker_helpers import GREEDY, consecutive_pages, forward_logits, make_runner

LOGITS_TOL = 1e-3  # fp32
MIN_EFFECT = 0.1
DECODE_STEPS = 5


@pytest.fixture(scope="module")
def vl_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_set(tmp_path_factory.mktemp("gemma3_vl"), tower=True)


@pytest.fixture(scope="module")
def runner(vl_set) -> ModelRunner:
    model_dir, adapters = vl_set
    runner = make_runner(model_dir, **LORA)
    load_all(runner, {name: adapters[name] for name in ("a4", "a8")})
    return runner


@pytest.fixture(scope="module")
def tower_runner(vl_set) -> ModelRunner:
    """--enable-tower-connector-lora, every language-model module in the pool."""
    model_dir, adapters = vl_set
    runner = make_runner(model_dir, **TOWER_LORA)
    load_all(runner, adapters)
    return runner


MIXED = [("one", None), ("two", None), ("text", None), ("one", "a4"), ("two", "a8"), ("text", "a8")]


def test_mixed_batch_matches_hf_and_peft(runner, vl_set) -> None:
    """One image, two and none, each with the base and an adapter, in one batch; the image blocks matter (HF without
    token_type_ids, all causal, differs)."""
    model_dir, adapters = vl_set
    prompts = [inputs(key) for key, _ in MIXED]
    names = [name for _, name in MIXED]
    lengths = [p["input_ids"].shape[1] for p in prompts]
    pages = consecutive_pages(lengths, runner.page_size)
    reqs = [request(p, pg, name, key=i) for i, (p, pg, name) in enumerate(zip(prompts, pages, names, strict=True))]
    with torch.inference_mode():
        logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=slot_loads(names)))
    for (key, name), hf, ours in zip(MIXED, prompts, logits.split(lengths), strict=True):
        ref = hf_logits(model_dir, hf, None if name is None else adapters[name])
        diff = (ours - ref).abs().max().item()
        assert diff <= LOGITS_TOL, f"{key}/{name or 'base'}: max abs logit diff {diff:.2e}"
        if name is not None:
            effect = (ref - hf_logits(model_dir, hf)).abs().max().item()
            assert effect > MIN_EFFECT, f"{name} barely changes the logits ({effect:.3f})"
    causal = {k: v for k, v in prompts[1].items() if k != "token_type_ids"}
    with torch.inference_mode():
        all_causal = hf_model(str(model_dir))(**causal).logits[0]
    assert (all_causal - logits.split(lengths)[1]).abs().max().item() > MIN_EFFECT


def test_chunked_prefill_keeps_each_image_whole(runner, vl_set) -> None:
    """A budget of 7 tokens a pass: the scheduler's cut (scheduler/image_runs.py) moves back to an image's start,
    or takes the run whole past the budget; every chunk's logits equal HF's rows of the whole prompt. A pass that
    ends inside a run is refused."""
    model_dir, adapters = vl_set
    hf = inputs("two")
    length = hf["input_ids"].shape[1]
    pages = consecutive_pages([length], runner.page_size)[0]
    images = request(hf, pages).images
    budget, starts, chunks = 7, [], []
    with torch.inference_mode():
        start = 0
        while start < length:
            num_new = whole_image_len(images, start, min(budget, length - start), alone=True)
            assert num_new > 0
            starts.append(start)
            req = request(hf, pages, "a4", start, start + num_new)
            chunks.append(forward_logits(runner, ForwardBatch(batch_id=len(starts), reqs=[req],
                                                              slot_loads=slot_loads(["a4"]))))  # fmt: skip
            start += num_new
    offsets = [image.offset for image in images]
    assert all(offset in starts for offset in offsets), (starts, offsets)  # each run begins a pass ...
    assert all(offset + images[0].num_tokens in starts + [length] for offset in offsets)  # ... and ends one
    diff = (torch.cat(chunks) - hf_logits(model_dir, hf, adapters["a4"])).abs().max().item()
    assert diff <= LOGITS_TOL, f"chunked prefill: max abs logit diff {diff:.2e}"
    cut = request(hf, pages, None, 0, offsets[0] + 3)
    with pytest.raises(BatchError, match="inside the image placeholder run"), torch.inference_mode():
        forward_logits(runner, ForwardBatch(batch_id=99, reqs=[cut]))


def test_a_prefix_hit_inside_an_image_attends_to_the_whole_run(runner, vl_set) -> None:
    """A request whose prefix-cache hit ends inside an image's run (pages written by a pass that held the run whole):
    the rest of the run attends to the cached part and both ways among itself, its rows from the kept embeddings
    (no second tower call); the logits past the hit equal HF's."""
    model_dir, adapters = vl_set
    hf = inputs("one")
    length = hf["input_ids"].shape[1]
    pages = consecutive_pages([length], runner.page_size)[0]
    first = request(hf, pages, "a4")
    [image] = first.images
    hit = image.offset + image.num_tokens // 2
    runner.images.done.clear()
    before = runner.images.num_encoded
    with torch.inference_mode():
        forward_logits(runner, ForwardBatch(batch_id=0, reqs=[first], slot_loads=slot_loads(["a4"])))
        cached = request(hf, pages, "a4", hit, length, key=1)
        assert cached.images == [image]
        logits = forward_logits(runner, ForwardBatch(batch_id=1, reqs=[cached], slot_loads=slot_loads(["a4"])))
    assert runner.images.num_encoded - before == 1
    diff = (logits - hf_logits(model_dir, hf, adapters["a4"])[hit:]).abs().max().item()
    assert diff <= LOGITS_TOL, f"hit inside the image: max abs logit diff {diff:.2e}"


@torch.inference_mode()
def hf_greedy(model_dir: Path, hf: dict, steps: int, adapter_dir: Path | None) -> tuple[list[int], list[float]]:
    out, margins = [], []
    for _ in range(steps):
        top2 = torch.topk(hf_logits(model_dir, hf, adapter_dir, extra=out)[-1], 2)
        out.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
    return out, margins


def test_greedy_decode_matches_hf(runner, vl_set) -> None:
    """Prefill with images, then decode steps (text tokens, causal) in one batch."""
    model_dir, adapters = vl_set
    cases = [("one", None), ("two", "a8"), ("text", None)]
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


def test_bad_images_fail_the_batch(runner) -> None:
    hf = inputs("one")
    pages = consecutive_pages([hf["input_ids"].shape[1]], runner.page_size)[0]
    good = request(hf, pages)
    image = good.images[0]
    bad = {  # what the error names -> the image
        "expected": msgspec_replace(image, shape=[1, 3, 16, 16]),
        "bytes": msgspec_replace(image, pixel_values=image.pixel_values[:-4]),
        "placeholder tokens": msgspec_replace(image, num_tokens=image.num_tokens - 1),
    }
    for what, image in bad.items():
        req = ForwardReq(input_ids=good.input_ids, num_cached_tokens=0, page_ids=pages, sampling=GREEDY,
                         images=[image])  # fmt: skip
        with pytest.raises(BatchError, match=what), torch.inference_mode():
            forward_logits(runner, ForwardBatch(batch_id=0, reqs=[req]))


def msgspec_replace(struct, **changes):
    import msgspec

    return msgspec.structs.replace(struct, **changes)


TOWER_MIXED = [("one", "a16"), ("one", None), ("two", "a4"), ("text", "a16"), ("two", "a16")]


def test_tower_lora_matches_peft(tower_runner, vl_set) -> None:
    """An adapter on the tower's attention and MLP (and the language model's q/v) beside one on the language model
    alone and the base, in one batch; the image shared by a16 and the base is encoded once for each."""
    model_dir, adapters = vl_set
    prompts = [inputs(key) for key, _ in TOWER_MIXED]
    names = [name for _, name in TOWER_MIXED]
    lengths = [p["input_ids"].shape[1] for p in prompts]
    pages = consecutive_pages(lengths, tower_runner.page_size)
    reqs = [request(p, pg, name, key=i) for i, (p, pg, name) in enumerate(zip(prompts, pages, names, strict=True))]
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


def test_the_triton_backend_runs_image_passes_on_torch_attention(vl_set) -> None:
    """The Triton kernels (interpreted here) are causal: a pass with images runs torch's SDPA with the image blocks
    over the same paged cache, a pass without stays on Triton; both equal HF."""
    model_dir, _ = vl_set
    runner = make_runner(model_dir, attention_backend="triton")
    assert runner.attention.name == "triton" and runner.image_attention.name == "torch"
    prompts = [inputs("one"), inputs("text")]
    lengths = [p["input_ids"].shape[1] for p in prompts]
    pages = consecutive_pages(lengths, runner.page_size)
    for batch_id, (hf, pg) in enumerate(zip(prompts, pages, strict=True)):
        with torch.inference_mode():
            ours = forward_logits(runner, ForwardBatch(batch_id=batch_id, reqs=[request(hf, pg, key=batch_id)]))
        diff = (ours - hf_logits(model_dir, hf)).abs().max().item()
        assert diff <= LOGITS_TOL, f"max abs logit diff {diff:.2e}"
