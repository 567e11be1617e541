"""Decoder pooling models under tensor parallelism: two gloo ranks (one spawn for both models) must reproduce tp=1's
pooled outputs for the base model and two adapters in one batch: a Qwen3-Embedding-style sentence-transformers
embedder (last token, normalised; adapters on attention and the MLP) and a Qwen3ForSequenceClassification whose
adapter "a" carries its own score head (modules_to_save=["score"], replicated on every rank) beside a plain one."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import torch
from loraplex.worker.model_runner import ModelRunner

from tests.builders import build_lora_adapter
from tests.pooling_models import build_classifier, build_score_adapter, build_st_embedder, load_adapters, pool
from tests.process.test_moe_tp import CHILD_TIMEOUT_S, tp_config
from tests.worker_helpers import random_prompts, run_two_ranks, tp_group

NAMES = [None, "a", "b", None, "a", "b"]  # tests/pooling_models.pool's slots
LENGTHS = [5, 5, 5, 11, 11, 11]  # two prompts, each under the base and both adapters
TOL = 1e-4


@torch.inference_mode()
def run_pooling(runner: ModelRunner, adapter_dirs: dict[str, str]) -> np.ndarray:
    """The mixed batch's pooled rows (prompts, out), as numpy (tensors die with a child)."""
    load_adapters(runner, {name: Path(path) for name, path in adapter_dirs.items()})
    first, second = random_prompts([LENGTHS[0], LENGTHS[3]], runner.vocab_size, seed=5)
    prompts = [first] * 3 + [second] * 3
    return pool(runner, prompts, NAMES).numpy()


def run_models(models: dict[str, tuple[str, dict[str, str]]], rank: int, tp: int) -> dict[str, np.ndarray]:
    config = tp_config(tp=tp)
    return {kind: run_pooling(ModelRunner(config, model_dir, rank, tp, "cpu"), dirs)
            for kind, (model_dir, dirs) in models.items()}  # fmt: skip


def tp_child(rank: int, port: int, models: dict[str, tuple[str, dict[str, str]]], results: mp.Queue) -> None:
    with tp_group(tp_config(tp=2), rank, port):
        results.put((rank, run_models(models, rank, 2)))


@pytest.fixture(scope="module")
def pooling_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, dict[str, str]]]:
    root = tmp_path_factory.mktemp("pooling_tp")
    causal = build_st_embedder(root / "embedder")
    embed_dirs = {"a": root / "embed_a", "b": root / "embed_b"}
    for seed, (path, targets) in enumerate(zip(embed_dirs.values(), (["q_proj", "o_proj", "down_proj"],
                                                                     ["k_proj", "v_proj", "gate_proj", "up_proj"]),
                                               strict=True)):  # fmt: skip
        build_lora_adapter(causal, path, r=8, lora_alpha=16, target_modules=targets, seed=seed + 1)
    build_classifier(root / "classifier")
    cls_dirs = {"a": root / "cls_a", "b": root / "cls_b"}
    build_score_adapter(root / "classifier", cls_dirs["a"], seed=3)  # LoRA and its own score head
    build_lora_adapter(root / "classifier", cls_dirs["b"], r=4, lora_alpha=8, target_modules=["o_proj", "up_proj"],
                       seed=4)  # fmt: skip
    config = json.loads((cls_dirs["b"] / "adapter_config.json").read_text())
    (cls_dirs["b"] / "adapter_config.json").write_text(json.dumps({**config, "task_type": None}))  # no score head
    return {"embed": (str(root / "embedder"), {n: str(p) for n, p in embed_dirs.items()}),
            "classify": (str(root / "classifier"), {n: str(p) for n, p in cls_dirs.items()})}  # fmt: skip


def test_decoder_pooling_tp2_matches_tp1(pooling_models: dict[str, tuple[str, dict[str, str]]]) -> None:
    by_rank = run_two_ranks(tp_child, pooling_models, timeout_s=CHILD_TIMEOUT_S)
    tp1 = run_models(pooling_models, 0, 1)
    assert tp1["embed"].shape == (len(NAMES), 64) and tp1["classify"].shape == (len(NAMES), 3)
    np.testing.assert_allclose(np.linalg.norm(tp1["embed"], axis=1), 1.0, atol=1e-5)  # normalised
    for rank in (0, 1):
        for kind in ("embed", "classify"):
            assert np.abs(by_rank[rank][kind] - tp1[kind]).max() <= TOL, (rank, kind)
    # each adapter moved its rows of one prompt (else equal outputs would prove nothing about them)
    for kind, out in tp1.items():
        for row in (1, 2, 4, 5):
            assert np.abs(out[row] - out[row - row % 3]).max() > 1e-2, (kind, row)
