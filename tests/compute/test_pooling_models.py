"""The pooling runner's outputs against HF (+ PEFT), in fp32, base and two adapters in one batch: a
sentence-transformers Qwen3 embedder (last token, mean, first token; normalised), Qwen3ForSequenceClassification (a
score head; one adapter carries its own, modules_to_save=["score"]) and a Qwen3 reranker scored by its yes/no logits.
The embedder against sentence-transformers itself: tests/server/test_pooling_server.py (which imports it once, for
the server tier)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.builders import build_lora_adapter
from tests.pooling_models import (
    LABELS,
    RERANKER_OVERRIDES,
    RERANKER_TOKENS,
    build_classifier,
    build_reranker,
    build_score_adapter,
    build_st_embedder,
    hf_classify_logits,
    hf_yes_no_scores,
    load_adapters,
    peft_embeddings,
    pool,
)
from tests.worker_helpers import make_runner, random_prompts

TEXTS = ["hello world", "The morning was cold and clear", "a", "He wrote quickly, then stopped."]
LORA = dict(enable_lora=True, max_lora_rank=8, max_loras_per_batch=2, lora_target_modules=["all"])
NAMES = [None, "a", "b", None, "a", "b"]  # base and two adapters, mixed in one batch


def assert_cosine(ours: torch.Tensor, ref: torch.Tensor) -> None:
    cosine = torch.nn.functional.cosine_similarity(ours, ref.float(), dim=-1)
    assert (cosine > 1 - 1e-4).all(), cosine
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(ours)), atol=1e-5, rtol=0)


def test_embedder_equals_peft(tmp_path: Path) -> None:
    model_dir = tmp_path / "embedder"
    causal = build_st_embedder(model_dir)
    dirs = {name: tmp_path / name for name in ("a", "b")}
    for seed, path in enumerate(dirs.values()):
        build_lora_adapter(causal, path, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                           seed=seed + 1)  # fmt: skip
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    runner = make_runner(model_dir, **LORA)
    assert runner.pooling is not None and runner.pooling.task == "embed" and runner.pooling.pooling_type == "last"
    load_adapters(runner, dirs)
    batch = prompts + prompts[:2]
    ours = pool(runner, batch, NAMES)
    for name in (None, "a", "b"):
        rows = [i for i, n in enumerate(NAMES) if n == name]
        assert_cosine(ours[rows], peft_embeddings(causal, [batch[i] for i in rows], dirs.get(name)))
    # the adapters change the output (else the comparison above proves nothing about them)
    assert torch.nn.functional.cosine_similarity(ours[1], ours[0], dim=0) < 0.999


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_classifier_equals_hf_with_a_score_head_adapter(tmp_path: Path, arch: str) -> None:
    model_dir = tmp_path / "classifier"
    build_classifier(model_dir, arch=arch)
    dirs = {"a": tmp_path / "a", "b": tmp_path / "b"}
    build_score_adapter(model_dir, dirs["a"], seed=1)  # LoRA and its own score head
    build_lora_adapter(model_dir, dirs["b"], r=4, lora_alpha=8, target_modules=["o_proj", "up_proj"], seed=2)
    config = json.loads((dirs["b"] / "adapter_config.json").read_text())
    # no task type: PEFT's SEQ_CLS would add the score head to modules_to_save, and this adapter has none
    (dirs["b"] / "adapter_config.json").write_text(json.dumps({**config, "task_type": None}))
    runner = make_runner(model_dir, **LORA)
    spec = runner.pooling
    assert (spec.task, spec.head, spec.num_labels, spec.labels) == ("classify", "score", 3, LABELS)
    load_adapters(runner, dirs)
    prompts = random_prompts([5, 9, 3, 12, 7, 4], runner.vocab_size, seed=0)
    ours = pool(runner, prompts, NAMES)
    for name in (None, "a", "b"):
        rows = [i for i, n in enumerate(NAMES) if n == name]
        ref = hf_classify_logits(model_dir, [prompts[i] for i in rows], dirs[name] if name else None)
        torch.testing.assert_close(ours[rows].softmax(-1), ref.softmax(-1), atol=1e-4, rtol=0)
        torch.testing.assert_close(ours[rows], ref, atol=1e-4, rtol=1e-4)
    assert (ours[1] - ours[0]).abs().max() > 1e-2  # the adapter's head is its own


def test_reranker_scores_equal_the_yes_no_softmax(tmp_path: Path) -> None:
    model_dir = tmp_path / "reranker"
    build_reranker(model_dir)
    dirs = {"a": tmp_path / "a", "b": tmp_path / "b"}
    for seed, path in enumerate(dirs.values()):
        build_lora_adapter(model_dir, path, r=8, lora_alpha=16, target_modules=["q_proj", "gate_proj"],
                           seed=seed + 3)  # fmt: skip
    runner = make_runner(model_dir, hf_overrides=RERANKER_OVERRIDES, **LORA)
    spec = runner.pooling
    assert (spec.task, spec.head, spec.num_labels, spec.pair_format) == ("classify", "tokens", 1, "qwen3_reranker")
    no_id, yes_id = spec.head_token_ids
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert [tokenizer.convert_tokens_to_ids(t) for t in RERANKER_TOKENS] == [no_id, yes_id]
    load_adapters(runner, dirs)
    prompts = random_prompts([5, 9, 3, 12, 7, 4], runner.vocab_size, seed=1)
    ours = torch.sigmoid(pool(runner, prompts, NAMES)[:, 0])
    for name in (None, "a", "b"):
        rows = [i for i, n in enumerate(NAMES) if n == name]
        ref = hf_yes_no_scores(model_dir, [prompts[i] for i in rows], yes_id, no_id, dirs[name] if name else None)
        torch.testing.assert_close(ours[rows], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("pooling_type", ["mean", "cls"])
def test_mean_and_first_token_pooling(tmp_path: Path, pooling_type: str) -> None:
    """A sentence-transformers config naming mean or CLS pooling: the mean (first) of the final states."""
    model_dir = tmp_path / "embedder"
    causal = build_st_embedder(model_dir)
    pooling_config = model_dir / "1_Pooling" / "config.json"
    config = json.loads(pooling_config.read_text())
    # sentence-transformers 5's string form; the builder writes the older flags
    config.update(pooling_mode=pooling_type, pooling_mode_lasttoken=False)
    pooling_config.write_text(json.dumps(config))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    runner = make_runner(model_dir)
    assert runner.pooling.pooling_type == pooling_type and runner.pooling.whole_prompt
    assert_cosine(pool(runner, prompts, [None] * len(prompts)), peft_embeddings(causal, prompts, None, pooling_type))
