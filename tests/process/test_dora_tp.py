"""DoRA under tensor parallelism: two gloo ranks serving one batch of DoRA, plain and base rows reproduce tp=1 (the
row-parallel modules' norms are summed over both ranks' input columns)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
from loraplex.protocol.config import ServerConfig
from loraplex.worker.model_runner import ModelRunner

from tests.lora_helpers import DORA_MIXED, build_dora_adapters, dora_batch_logits
from tests.worker_helpers import random_prompts, run_two_ranks, tp_group

DORA_CONFIG = dict(enable_lora=True, max_lora_rank=8, lora_target_modules=["all"], max_loras_per_batch=3)
PROMPT_LENGTHS = [5, 9, 3, 7, 6, 8, 4]


def tp_config(tp: int) -> ServerConfig:
    return ServerConfig(device="cpu", tp=tp, page_size=4, max_total_tokens=512, **DORA_CONFIG)


def run_dora(runner: ModelRunner, dirs: dict[str, str]) -> list:
    prompts = random_prompts(PROMPT_LENGTHS, runner.vocab_size, seed=23)
    return [t.numpy() for t in dora_batch_logits(runner, dirs, prompts, DORA_MIXED)]  # numpy: see test_lora_tp


def tp_child(rank: int, port: int, model_dir: str, dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        results.put((rank, run_dora(ModelRunner(config, model_dir, rank, 2, "cpu"), dirs)))


@pytest.fixture(scope="module")
def dora_dirs(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> dict[str, str]:
    return {name: str(path) for name, path in build_dora_adapters(llama_dir, tmp_path_factory.mktemp("dora")).items()}


def test_dora_tp2_matches_tp1(llama_dir: Path, dora_dirs: dict[str, str]) -> None:
    by_rank = run_two_ranks(tp_child, str(llama_dir), dora_dirs, timeout_s=120)
    tp1 = run_dora(ModelRunner(tp_config(tp=1), str(llama_dir), 0, 1, "cpu"), dora_dirs)
    for rank in (0, 1):
        for name, ours, ref in zip(DORA_MIXED, by_rank[rank], tp1, strict=True):
            diff = abs(ours - ref).max()
            assert diff <= 1e-4, (rank, name, diff)
