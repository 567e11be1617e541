"""Gemma 2 and Gemma 3 under tensor parallelism: two gloo ranks serving the base model and two adapters in one batch,
with prompts past the sliding window, must reproduce tp=1."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import AdapterToLoad, SlotLoad
from loraplex.worker.model_runner import ModelRunner

from tests.builders import build_lora_adapter
from tests.gemma_helpers import WINDOW, build_tiny_gemma
from tests.worker_helpers import Seq, random_prompts, run_greedy_schedule, run_two_ranks, tp_group

STEPS = 5
NAMES = [None, "a", "b", "a"]
SLOTS = [-1, 0, 1, 0]


def tp_config(tp: int) -> ServerConfig:
    return ServerConfig(device="cpu", tp=tp, page_size=4, max_total_tokens=512, enable_lora=True, max_lora_rank=8,
                        lora_target_modules=["all"], max_loras_per_batch=2)  # fmt: skip


def run_batch(runner: ModelRunner, adapter_dirs: dict[str, str]) -> list[list[int]]:
    specs = [AdapterToLoad(lora_name=name, lora_path=path, lora_id=i + 1)
             for i, (name, path) in enumerate(sorted(adapter_dirs.items()))]  # fmt: skip
    assert all(r.success for r in runner.lora.load(specs))
    prompts = random_prompts([3 * WINDOW, 5, 3 * WINDOW + 2, 2 * WINDOW], runner.vocab_size, seed=4)
    seqs = [Seq(prompt=p, prefill_chunk=6 if i == 2 else len(p), slot=slot)
            for i, (p, slot) in enumerate(zip(prompts, SLOTS, strict=True))]  # fmt: skip
    loads = [SlotLoad(slot=0, lora_id=1), SlotLoad(slot=1, lora_id=2)]
    return run_greedy_schedule(runner, seqs, [0, 0, 0, 1], STEPS, slot_loads=loads)


def tp_child(rank: int, port: int, model_dir: str, adapter_dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        results.put((rank, run_batch(ModelRunner(config, model_dir, rank, 2, "cpu"), adapter_dirs)))


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_tp2_matches_tp1(tmp_path: Path, family: str) -> None:
    model_dir = tmp_path / family
    build_tiny_gemma(model_dir, family)
    adapter_dirs = {}
    for seed, (name, targets) in enumerate((("a", ("q_proj", "o_proj", "down_proj", "up_proj")),
                                            ("b", ("k_proj", "v_proj", "gate_proj"))), start=1):  # fmt: skip
        adapter_dirs[name] = str(tmp_path / name)
        build_lora_adapter(model_dir, adapter_dirs[name], r=8, lora_alpha=16, target_modules=targets, seed=seed)
    by_rank = run_two_ranks(tp_child, str(model_dir), adapter_dirs, timeout_s=180)
    tp1 = run_batch(ModelRunner(tp_config(tp=1), str(model_dir), 0, 1, "cpu"), adapter_dirs)
    assert by_rank[0] == by_rank[1] == tp1
    assert len({tuple(out) for out in tp1}) > 1  # not one degenerate output for every request
