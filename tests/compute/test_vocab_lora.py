"""LoRA on embed_tokens and lm_head (PEFT's lora_embedding_A/B and the head's lora_A/B) against HF + peft: mixed in
one batch with the base model and an adapter without them, on the torch and the CPU LoRA backends (both compute
these layers with torch ops), with untied and tied embeddings; what such an adapter may not carry is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from loraplex.kernels import cpu_ext
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, SlotLoad
from loraplex.worker.lora.vocab import LoRAEmbedding, LoRALMHead
from loraplex.worker.model_runner import ModelRunner

from tests.lora_helpers import build_peft_adapter
from tests.phi3_helpers import PHI4_MINI_LIKE, build_tiny_phi3
from tests.reference import assert_greedy_match, hf_greedy, hf_model
from tests.worker_helpers import GREEDY, PAGE_SIZE, decode, forward_logits, make_runner, random_prompts

FP32_TOL = 1e-4
LORA = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["all", "embed_tokens", "lm_head"],
            max_loras_per_batch=3)  # fmt: skip
ADAPTERS = {  # name -> (lora_id, slot, r, targets)
    "vocab": (1, 0, 8, ("embed_tokens", "lm_head", "q_proj", "down_proj")),
    "embed_only": (2, 1, 4, ("embed_tokens",)),
    "plain": (3, 2, 4, ("q_proj", "v_proj")),
}
PHI3_NAMES = {"q_proj": "qkv_proj", "v_proj": "o_proj"}
MIXED = [None, "vocab", "plain", "embed_only", "vocab", None]
LENGTHS = [5, 9, 7, 4, 6, 3]
DECODE_STEPS = 6
BF16_TOL = 1.0  # bfloat16 against float32 logits of magnitude ~10 (seen: 0.6)


@pytest.fixture(scope="module", params=["llama", "phi3_tied"])
def vocab_case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> dict:
    root = tmp_path_factory.mktemp(f"vocab_{request.param}")
    if request.param == "llama":
        base = llama_dir
    else:
        base = root / "base"
        build_tiny_phi3(base, **PHI4_MINI_LIKE)  # tied embeddings: the head's LoRA on the shared weight
    adapters = {}
    for seed, (name, (_, _, r, targets)) in enumerate(ADAPTERS.items(), start=31):
        if request.param == "phi3_tied":  # Phi-3's fused names
            targets = tuple(dict.fromkeys(PHI3_NAMES.get(t, t) for t in targets))
        adapters[name] = root / name
        build_peft_adapter(base, adapters[name], r=r, lora_alpha=2 * r, target_modules=targets, seed=seed)
    runner = make_runner(base, **LORA)
    results = runner.lora.load(
        [AdapterToLoad(lora_name=n, lora_path=str(p), lora_id=ADAPTERS[n][0]) for n, p in adapters.items()]
    )
    assert all(r.success for r in results), [r.error_message for r in results]
    return dict(base=base, adapters=adapters, runner=runner)


def _slot(name: str | None) -> int:
    return -1 if name is None else ADAPTERS[name][1]


def _slot_loads() -> list[SlotLoad]:
    return [SlotLoad(slot=slot, lora_id=lora_id) for lora_id, slot, *_ in ADAPTERS.values()]


def _adapter(case: dict, name: str | None) -> str | None:
    return None if name is None else str(case["adapters"][name])


def _mixed_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    pages, first = [], 0
    for prompt in prompts:
        pages.append(list(range(first, first + -(-len(prompt) // PAGE_SIZE))))
        first += len(pages[-1])
    reqs = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=_slot(n))
            for p, pg, n in zip(prompts, pages, MIXED, strict=True)]  # fmt: skip
    return forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=_slot_loads()))  # (tokens, vocab)


@torch.inference_mode()
def test_mixed_batch_matches_peft(vocab_case: dict) -> None:
    runner: ModelRunner = vocab_case["runner"]
    assert runner.backend.name == "torch"
    assert isinstance(runner.model.model.embed_tokens, LoRAEmbedding) and isinstance(runner.model.lm_head, LoRALMHead)
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=41)
    logits = _mixed_logits(runner, prompts)
    base_model = hf_model(str(vocab_case["base"]))
    for prompt, name, ours in zip(prompts, MIXED, logits.split(LENGTHS), strict=True):
        ref = hf_model(str(vocab_case["base"]), _adapter(vocab_case, name))(torch.tensor([prompt])).logits[0]
        assert (ours - ref).abs().max().item() <= FP32_TOL, name
        if name is not None:
            assert (ref - base_model(torch.tensor([prompt])).logits[0]).abs().max().item() > 0.1, name
    # greedy decoding: the head's LoRA on the last rows only, the embedding's on each new token
    outputs = decode(runner, prompts, [GREEDY] * len(prompts), DECODE_STEPS, slots=[_slot(n) for n in MIXED],
                     slot_loads=_slot_loads())  # fmt: skip
    for prompt, name, out in zip(prompts, MIXED, outputs, strict=True):
        ref, margins = hf_greedy(vocab_case["base"], prompt, DECODE_STEPS, _adapter(vocab_case, name))
        assert_greedy_match(out, ref, margins, what=name or "base")


@pytest.mark.parametrize("vocab_case", ["llama"], indirect=True)
@pytest.mark.skipif(cpu_ext.unavailable_reason() is not None,
                    reason=f"CPU kernels cannot run here: {cpu_ext.unavailable_reason()}")  # fmt: skip
@torch.inference_mode()
def test_cpu_backend_in_bfloat16_matches_float32(vocab_case: dict) -> None:
    # The CPU backend (bfloat16 only) runs the decoder's LoRA in its kernels and these layers' in the same torch ops.
    runner = make_runner(vocab_case["base"], dtype="bfloat16", lora_backend="cpu", **LORA)
    assert runner.backend.name == "cpu" and isinstance(runner.model.lm_head, LoRALMHead)
    results = runner.lora.load([AdapterToLoad(lora_name=n, lora_path=str(p), lora_id=ADAPTERS[n][0])
                                for n, p in vocab_case["adapters"].items()])  # fmt: skip
    assert all(r.success for r in results)
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=43)
    ours = _mixed_logits(runner, prompts).split(LENGTHS)
    ref = _mixed_logits(vocab_case["runner"], prompts).split(LENGTHS)  # float32, equal to peft (above)
    for name, got, want in zip(MIXED, ours, ref, strict=True):
        assert (got - want).abs().max().item() <= BF16_TOL, name
    # "embed_only" has nothing but its embedding's LoRA: served as the base, it would be off by far more
    base_row = _mixed_logits(vocab_case["runner"], [prompts[MIXED.index("embed_only")]] * len(MIXED))
    effect = (ref[MIXED.index("embed_only")] - base_row.split(LENGTHS[3])[0]).abs().max().item()
    assert effect > 3 * BF16_TOL


def test_the_vocab_terms_are_really_computed(vocab_case: dict) -> None:
    # Without the embedding's and the head's LoRA, "vocab" and "embed_only" would be served wrong: proof that the
    # comparison above covers them (their A and B are not zero, and they move the logits).
    runner: ModelRunner = vocab_case["runner"]
    vocab = runner.lora.pool.vocab
    assert set(vocab) == {"embed_tokens", "lm_head"}
    assert vocab["embed_tokens"].host_ranks == [8, 4, 0] and vocab["lm_head"].host_ranks == [8, 0, 0]
    assert vocab["embed_tokens"].lora_a.shape == (3, runner.vocab_size, 8)


def _save_peft(base: Path, out: Path, **kwargs) -> Path:
    build_peft_adapter(base, out, r=4, lora_alpha=8, target_modules=("embed_tokens", "q_proj"), seed=5, **kwargs)
    return out


@pytest.mark.parametrize(
    "change, message",
    [
        ({"save_embedding_layers": True}, "is a full copy of the base model's embed_tokens"),
        ({"config": {"modules_to_save": ["lm_head"]}}, "modules_to_save"),
        ({"config": {"trainable_token_indices": [3, 4]}}, "trainable_token_indices"),
    ],
)
def test_what_an_embedding_adapter_may_not_carry_is_refused_by_name(
    llama_dir: Path, tmp_path: Path, change: dict, message: str
) -> None:
    adapter = _save_peft(llama_dir, tmp_path / "a", save_embedding_layers=change.get("save_embedding_layers", False))
    if "config" in change:
        path = adapter / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **change["config"]}))
    runner = make_runner(llama_dir, **LORA)
    [outcome] = runner.lora.load([AdapterToLoad(lora_name="a", lora_path=str(adapter), lora_id=1)])
    assert not outcome.success and message in outcome.error_message, outcome.error_message


def test_an_embedding_adapter_needs_a_pool_that_covers_it(llama_dir: Path, tmp_path: Path) -> None:
    adapter = _save_peft(llama_dir, tmp_path / "a")
    runner = make_runner(llama_dir, **{**LORA, "lora_target_modules": ["all"]})
    assert not runner.lora.pool.vocab and not isinstance(runner.model.lm_head, LoRALMHead)
    [outcome] = runner.lora.load([AdapterToLoad(lora_name="a", lora_path=str(adapter), lora_id=1)])
    assert not outcome.success and "'embed_tokens' is not in the LoRA pool" in outcome.error_message


@torch.inference_mode()
def test_a_base_batch_after_an_adapter_batch_keeps_no_slots_of_it(vocab_case: dict) -> None:
    # A longer base-only batch right after a short adapter batch: the head must not read the earlier batch's slots.
    runner: ModelRunner = vocab_case["runner"]
    short = random_prompts([2], runner.vocab_size, seed=50)
    decode(runner, short, [GREEDY], 1, slots=[_slot("vocab")], slot_loads=_slot_loads())
    prompts = random_prompts([9, 11], runner.vocab_size, seed=51)
    ours = decode(runner, prompts, [GREEDY] * 2, 3)
    for prompt, out in zip(prompts, ours, strict=True):
        ref, margins = hf_greedy(vocab_case["base"], prompt, 3)
        assert_greedy_match(out, ref, margins, what="base")
