"""Qwen2.5-VL in the worker (M-RoPE decoder, windowed vision tower, image rows in place of placeholder tokens)
against HF transformers + peft in fp32: prompts with one image, two images and none in one batch with the base model
and two language-model adapters; a chunked prefill whose chunks cut an image's run; a prefix hit that ends inside
one (its rows from the kept embeddings, no second tower call); greedy decoding; the M-RoPE
positions of protocol/mrope.py against HF's get_rope_index; bad images refused with a BatchError."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from loraplex.protocol.mrope import mrope_positions
from loraplex.protocol.structs import ForwardBatch, ForwardReq, ImageInput
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.model_runner import ModelRunner

from tests.lora_helpers import load_all, slot_loads, slot_of, specs
from tests.reference import CLEAR_MARGIN, assert_greedy_match
from tests.vision_models import MERGE
from tests.vision_requests import (
    LORA,
    TOWER_LORA,
    build_vl_set,
    hf_logits,
    hf_vl,
    image_token_id,
    inputs,
    request,
)
from tests.worker_helpers import GREEDY, consecutive_pages, forward_logits, make_runner

LOGITS_TOL = 1e-3  # fp32
MIN_ADAPTER_EFFECT = 0.1
DECODE_STEPS = 5


@pytest.fixture(scope="module")
def vl_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_vl_set(tmp_path_factory.mktemp("qwen2_5_vl"), tower=True)


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
    """One image, two images and none, each with the base and an adapter, in one batch (the same image in several
    requests, encoded once)."""
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
            assert effect > MIN_ADAPTER_EFFECT, f"{name} barely changes the logits ({effect:.3f})"
    # the images matter: the same prompt with its images' rows left as placeholder embeddings differs
    plain = request(prompts[0], pages[0])
    with torch.inference_mode():
        without = forward_logits(runner, ForwardBatch(batch_id=1, reqs=[ForwardReq(
            input_ids=plain.input_ids, num_cached_tokens=0, page_ids=pages[0], sampling=GREEDY,
            mrope_positions=plain.mrope_positions)]))  # fmt: skip
    assert (without - logits.split(lengths)[0]).abs().max().item() > MIN_ADAPTER_EFFECT


def test_chunked_prefill_cuts_an_image(runner, vl_set) -> None:
    """Chunks of 7 tokens: the first image's run (offset 1, 16 tokens) spans three passes, the second's is cut too;
    each pass carries only the images it overlaps, and each image is encoded once (kept between the passes). Every
    chunk's logits equal HF's rows of the whole prompt."""
    model_dir, adapters = vl_set
    hf = inputs("two")
    length = hf["input_ids"].shape[1]
    pages = consecutive_pages([length], runner.page_size)[0]
    chunks = []
    runner.images.done.clear()  # the earlier tests' images (the same ones) are kept: these must go through the tower
    encoded = []  # the images each tower call encodes: every image once, though chunks cut both
    encode = runner.model.encode_images
    runner.model.encode_images = lambda pixels, grids: encoded.append(grids) or encode(pixels, grids)
    try:
        with torch.inference_mode():
            for batch_id, start in enumerate(range(0, length, 7)):
                req = request(hf, pages, "a4", start, min(start + 7, length))
                chunks.append(forward_logits(runner, ForwardBatch(batch_id=batch_id, reqs=[req],
                                                                  slot_loads=slot_loads(["a4"]))))  # fmt: skip
    finally:
        runner.model.encode_images = encode
    assert [grid for grids in encoded for grid in grids] == hf["image_grid_thw"].tolist()
    assert not runner.images.partial  # the last chunk took the last image's last rows
    carried = [tuple(i.offset for i in request(hf, pages, None, s, s + 7).images) for s in range(0, length, 7)]
    # each image cut over several passes, each pass carrying only the one it overlaps
    assert all(len(c) == 1 for c in carried) and all(carried.count(c) > 1 for c in set(carried)), carried
    diff = (torch.cat(chunks) - hf_logits(model_dir, hf, adapters["a4"])).abs().max().item()
    assert diff <= LOGITS_TOL, f"chunked prefill: max abs logit diff {diff:.2e}"


def test_a_prefix_hit_inside_an_image_takes_its_kept_rows(runner, vl_set) -> None:
    """A request whose prefix-cache hit ends inside an image's placeholder run (the scheduler sends the image with
    the pass over the rest) takes the rows past the hit from the embeddings the first request's pass kept: the tower
    runs once for both, and the second pass's logits equal HF's rows of the whole prompt past the hit."""
    model_dir, adapters = vl_set
    hf = inputs("one")
    length = hf["input_ids"].shape[1]
    pages = consecutive_pages([length], runner.page_size)[0]
    first = request(hf, pages, "a4")
    [image] = first.images
    hit = image.offset + image.num_tokens // 2  # inside the run
    runner.images.done.clear()  # an earlier test's pass kept this image
    before = runner.images.num_encoded
    with torch.inference_mode():
        forward_logits(runner, ForwardBatch(batch_id=0, reqs=[first], slot_loads=slot_loads(["a4"])))
        # the cached pages are the first request's: the second writes the same KV past the hit
        cached = request(hf, pages, "a4", hit, length, key=1)
        assert cached.images == [image]
        logits = forward_logits(runner, ForwardBatch(batch_id=1, reqs=[cached], slot_loads=slot_loads(["a4"])))
    assert runner.images.num_encoded - before == 1  # the hit's pass ran no tower
    diff = (logits - hf_logits(model_dir, hf, adapters["a4"])[hit:]).abs().max().item()
    assert diff <= LOGITS_TOL, f"hit inside the image: max abs logit diff {diff:.2e}"


@torch.inference_mode()
def hf_greedy(model_dir: Path, hf: dict, steps: int, adapter_dir: Path | None) -> tuple[list[int], list[float]]:
    """Greedy continuation, the whole sequence each step (HF recomputes its M-RoPE rows), and each step's margin."""
    out, margins = [], []
    for _ in range(steps):
        top2 = torch.topk(hf_logits(model_dir, hf, adapter_dir, extra=out)[-1], 2)
        out.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
    return out, margins


def test_greedy_decode_matches_hf(runner, vl_set) -> None:
    """Prefill then decode in one batch: the decode passes carry no rows, only mrope_delta (one image, two images,
    an adapter's row beside the base's)."""
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
                           slot=slot_of(name), req_key=i, mrope_delta=req.mrope_delta)
                for i, (out, n, pg, name, req) in enumerate(zip(outputs, lengths, pages, names, reqs, strict=True))]
        for out, token in zip(outputs, runner.forward(ForwardBatch(batch_id=step, reqs=reqs)), strict=True):
            out.append(token)
    runner.forward(ForwardBatch(batch_id=DECODE_STEPS, reqs=[], released_keys=list(range(len(cases)))))
    compared = 0
    for (key, name), hf, out in zip(cases, prompts, outputs, strict=True):
        ref, margins = hf_greedy(model_dir, hf, DECODE_STEPS, None if name is None else adapters[name])
        compared += assert_greedy_match(out, ref, margins, what=f"{key}/{name or 'base'}")
    assert compared >= DECODE_STEPS * len(cases) // 2, f"only {compared} tokens had a clear margin (> {CLEAR_MARGIN})"


def test_mrope_positions_match_hf_get_rope_index(vl_set) -> None:
    """protocol/mrope.py's rows and delta equal HF's for one image and two (text after each)."""
    model_dir, _ = vl_set
    model = hf_vl(str(model_dir))
    for key in ("one", "two"):
        hf = inputs(key)
        ids = hf["input_ids"][0].tolist()
        rows, delta = mrope_positions(ids, image_token_id(), hf["image_grid_thw"].tolist(), MERGE)
        ref, ref_delta = model.model.get_rope_index(hf["input_ids"], mm_token_type_ids=hf["mm_token_type_ids"],
                                                    image_grid_thw=hf["image_grid_thw"])  # fmt: skip
        assert rows == ref[:, 0].tolist() and delta == int(ref_delta[0]), key
        assert delta < 0  # an image costs fewer positions than tokens


def test_bad_images_fail_the_batch(runner) -> None:
    hf = inputs("one")
    pages = consecutive_pages([hf["input_ids"].shape[1]], runner.page_size)[0]
    good = request(hf, pages)
    image = good.images[0]
    bad = {  # what the error names -> the image
        "merge blocks": ImageInput(offset=image.offset, num_tokens=image.num_tokens, content_hash="g",
                           pixel_values=image.pixel_values, shape=image.shape, grid_thw=[1, 8, 7]),
        "bytes": ImageInput(offset=image.offset, num_tokens=image.num_tokens, content_hash="b",
                            pixel_values=image.pixel_values[:-4], shape=image.shape, grid_thw=image.grid_thw),
        "not its placeholder": ImageInput(offset=image.offset - 1, num_tokens=image.num_tokens, content_hash="p",
                                  pixel_values=image.pixel_values, shape=image.shape, grid_thw=image.grid_thw),
    }  # fmt: skip
    for what, image in bad.items():
        req = ForwardReq(input_ids=good.input_ids, num_cached_tokens=0, page_ids=pages, sampling=GREEDY,
                         images=[image], mrope_positions=good.mrope_positions)  # fmt: skip
        with pytest.raises(BatchError, match=what), torch.inference_mode():
            forward_logits(runner, ForwardBatch(batch_id=0, reqs=[req]))


TOWER_MIXED = [("one", "a16"), ("one", None), ("two", "a4"), ("text", "a16"), ("two", "a16")]


def test_tower_lora_matches_peft(tower_runner, vl_set) -> None:
    """--enable-tower-connector-lora: an adapter on the tower's attention, MLP and merger (and the language model)
    beside one with none there and the base, in one batch; the image shared by a16 and the base is encoded once
    for each, and its rows differ."""
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
    assert (with_adapter - base).abs().max().item() > MIN_ADAPTER_EFFECT  # the tower's adapter moved the rows


def test_tower_adapter_refused_without_the_flag(runner, vl_set) -> None:
    _, adapters = vl_set
    (outcome,) = runner.lora.load(specs({"a16": adapters["a16"]}, {"a16": 3}))
    assert not outcome.success and "--enable-tower-connector-lora" in outcome.error_message, outcome


def test_transformers_5_checkpoint_names_load(vl_set, tmp_path: Path) -> None:
    """The same weights saved under transformers 5's module names (model.language_model.*, model.visual.*) serve
    the same logits."""
    from safetensors.torch import load_file, save_file

    model_dir, _ = vl_set
    renamed = tmp_path / "t5"
    shutil.copytree(model_dir, renamed)
    tensors = load_file(renamed / "model.safetensors")
    moved = {("model." + key if key.startswith("visual.") else key.replace("model.", "model.language_model.", 1)
              if key.startswith("model.") else key): t for key, t in tensors.items()}  # fmt: skip
    assert {k.split(".")[1] for k in moved if k.startswith("model.")} == {"visual", "language_model"}
    save_file(moved, renamed / "model.safetensors")
    hf = inputs("one")
    length = hf["input_ids"].shape[1]
    runner = make_runner(renamed)
    with torch.inference_mode():
        ours = forward_logits(runner, ForwardBatch(batch_id=0, reqs=[request(hf, consecutive_pages([length], 4)[0])]))
    diff = (ours - hf_logits(model_dir, hf)).abs().max().item()
    assert diff <= LOGITS_TOL, f"max abs logit diff {diff:.2e}"


def test_draft_model_drafts_after_an_image_prompt(runner, vl_set) -> None:
    """Speculative decoding with a draft model (the VL checkpoint itself, which as a draft reads the placeholders as
    tokens, without images, at plain positions): a prefill pass with images and M-RoPE rows that asks for drafts runs
    (its rows continued over the drafts), and the tokens it accepts (here the draft disagrees: none) and samples equal
    plain greedy decoding's."""
    model_dir, _ = vl_set
    spec = make_runner(model_dir, speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                                      "model": str(model_dir)})  # fmt: skip
    hf = inputs("two")
    length = hf["input_ids"].shape[1]
    pages = consecutive_pages([length + DECODE_STEPS], spec.page_size)[0]
    req = msgspec.structs.replace(request(hf, pages), num_model_drafts=3)
    step = spec.step(ForwardBatch(batch_id=0, reqs=[req]))
    spec.forward(ForwardBatch(batch_id=1, reqs=[], released_keys=[0]))
    accepted = [*step.accepted_ids[0], step.tokens[0]] if step.accepted_ids else step.tokens
    plain = [runner.forward(ForwardBatch(batch_id=2, reqs=[request(hf, pages)]))[0]]
    runner.forward(ForwardBatch(batch_id=3, reqs=[], released_keys=[0]))
    for i in range(1, len(accepted)):  # plain greedy decoding for as many tokens
        plain += runner.forward(ForwardBatch(batch_id=3 + i, reqs=[ForwardReq(
            input_ids=plain[-1:], num_cached_tokens=length + i - 1, page_ids=pages, num_generated=i,
            sampling=GREEDY, mrope_delta=req.mrope_delta)]))  # fmt: skip
    assert accepted == plain, (accepted, plain)


def test_a_text_model_refuses_images_and_mrope_rows(llama_dir) -> None:
    text_runner = make_runner(llama_dir)
    hf = inputs("one")
    good = request(hf, consecutive_pages([hf["input_ids"].shape[1]], 4)[0])
    ids = [t % text_runner.vocab_size for t in good.input_ids]
    for what, req in {
        "M-RoPE": ForwardReq(input_ids=ids, num_cached_tokens=0, page_ids=good.page_ids, sampling=GREEDY,
                             mrope_positions=good.mrope_positions),
        "no vision tower": ForwardReq(input_ids=ids, num_cached_tokens=0, page_ids=good.page_ids, sampling=GREEDY,
                                      images=good.images),
    }.items():  # fmt: skip
        with pytest.raises(BatchError, match=what), torch.inference_mode():
            forward_logits(text_runner, ForwardBatch(batch_id=0, reqs=[req]))
