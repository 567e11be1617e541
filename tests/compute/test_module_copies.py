"""PEFT's modules_to_save (full copies of embed_tokens and lm_head) and trainable_token_indices (a patch of embedding
rows, the head's too with tied embeddings) against HF + peft in fp32: in one batch with a plain adapter and the base
model; the copies' budget (--max-full-module-copies) refuses by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, SlotLoad

from tests.lora_helpers import build_peft_adapter
from tests.phi3_helpers import PHI4_MINI_LIKE, build_tiny_phi3
from tests.reference import hf_model
from tests.worker_helpers import GREEDY, PAGE_SIZE, decode, forward_logits, make_runner, random_prompts

FP32_TOL = 1e-4
TOKENS = [3, 5, 7]  # the trainable tokens, put into every prompt
LORA = dict(enable_lora=True, max_lora_rank=4, lora_target_modules=["all"], max_loras_per_batch=3)
ADAPTERS = {  # name -> (lora_id, slot, extra LoraConfig fields)
    "copies": (1, 0, {"modules_to_save": ["lm_head", "embed_tokens"]}),
    "tokens": (2, 1, {"trainable_token_indices": TOKENS}),
    "plain": (3, 2, {}),
}
MIXED = [None, "copies", "plain", "tokens", "copies", "tokens"]
LENGTHS = [5, 7, 6, 8, 4, 6]


def _build(base: Path, root: Path, names: tuple[str, ...], targets: tuple[str, ...] = ("q_proj",)) -> dict[str, Path]:
    paths = {}
    for seed, name in enumerate(names, start=61):
        paths[name] = root / name
        build_peft_adapter(base, paths[name], r=4, lora_alpha=8, target_modules=targets, seed=seed,
                           **ADAPTERS[name][2])  # fmt: skip
    return paths


def _prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    prompts = random_prompts(lengths, vocab_size, seed=seed)
    return [p[:1] + TOKENS + p[1 + len(TOKENS) :] for p in prompts]  # lengths kept (each >= 4)


def _logits(runner, prompts: list[list[int]], names: list[str | None], adapters: tuple[str, ...]) -> torch.Tensor:
    pages, first = [], 0
    for prompt in prompts:
        pages.append(list(range(first, first + -(-len(prompt) // PAGE_SIZE))))
        first += len(pages[-1])
    reqs = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY,
                       slot=-1 if n is None else ADAPTERS[n][1])
            for p, pg, n in zip(prompts, pages, names, strict=True)]  # fmt: skip
    loads = [SlotLoad(slot=ADAPTERS[n][1], lora_id=ADAPTERS[n][0]) for n in adapters]
    return forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=loads))  # (tokens, vocab)


def _load(runner, paths: dict[str, Path]) -> None:
    results = runner.lora.load([AdapterToLoad(lora_name=n, lora_path=str(p), lora_id=ADAPTERS[n][0])
                                for n, p in paths.items()])  # fmt: skip
    assert all(r.success for r in results), [r.error_message for r in results]


@torch.inference_mode()
def test_copies_and_tokens_in_one_batch_match_peft(llama_dir: Path, tmp_path: Path) -> None:
    paths = _build(llama_dir, tmp_path, tuple(ADAPTERS))
    runner = make_runner(llama_dir, **LORA)
    _load(runner, paths)
    prompts = _prompts(runner.vocab_size, LENGTHS, seed=67)
    logits = _logits(runner, prompts, MIXED, tuple(ADAPTERS))
    base_model = hf_model(str(llama_dir))
    for prompt, name, ours in zip(prompts, MIXED, logits.split(LENGTHS), strict=True):
        adapter = None if name is None else str(paths[name])
        ref = hf_model(str(llama_dir), adapter)(torch.tensor([prompt])).logits[0]
        assert (ours - ref).abs().max().item() <= FP32_TOL, name
        if name is not None:  # the copies and the token rows really move the logits
            assert (ref - base_model(torch.tensor([prompt])).logits[0]).abs().max().item() > 0.1, name
    # a short batch on the copies, then a longer one without them: the head reads none of the short one's rows
    _logits(runner, [prompts[1][:4]], ["copies"], ("copies",))
    tokens = decode(runner, [prompts[0], prompts[2]], [GREEDY] * 2, 1, slots=[-1, ADAPTERS["plain"][1]])
    assert tokens == [[int(logits.split(LENGTHS)[i][-1].argmax())] for i in (0, 2)]
    runner.lora.drop([ADAPTERS["copies"][0]])
    assert not runner.lora.copies.holders and not any(runner.lora.copies.slot_copies)


@torch.inference_mode()
def test_tied_trainable_tokens_patch_the_head_too(tmp_path: Path) -> None:
    base = tmp_path / "phi3"
    build_tiny_phi3(base, **PHI4_MINI_LIKE)  # tied embeddings
    paths = _build(base, tmp_path, ("tokens", "plain"), targets=("qkv_proj",))  # Phi-3's fused name
    runner = make_runner(base, **LORA)
    _load(runner, paths)
    names = ["tokens", None, "plain"]
    prompts = _prompts(runner.vocab_size, [6, 5, 7], seed=71)
    logits = _logits(runner, prompts, names, ("tokens", "plain"))
    for prompt, name, ours in zip(prompts, names, logits.split([6, 5, 7]), strict=True):
        ref = hf_model(str(base), None if name is None else str(paths[name]))(torch.tensor([prompt])).logits[0]
        assert (ours - ref).abs().max().item() <= FP32_TOL, name


@pytest.mark.parametrize("budget", [0, 1])
def test_copies_past_the_budget_are_refused_by_name(llama_dir: Path, tmp_path: Path, budget: int) -> None:
    paths = _build(llama_dir, tmp_path, ("copies",))
    runner = make_runner(llama_dir, max_full_module_copies=budget, **LORA)
    specs = [AdapterToLoad(lora_name=f"c{i}", lora_path=str(paths["copies"]), lora_id=10 + i) for i in range(2)]
    outcomes = runner.lora.load(specs)
    assert [o.success for o in outcomes] == [True] * budget + [False] * (2 - budget)
    refused = outcomes[budget]
    assert refused.error_kind == "invalid" and "--max-full-module-copies" in refused.error_message
    runner.lora.drop([10])  # a place freed is taken again
    if budget:
        assert runner.lora.load(specs[1:])[0].success
