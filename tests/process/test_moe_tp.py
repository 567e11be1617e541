"""MoE models under tensor parallelism: two gloo ranks, each holding half of every expert's intermediate dimension
(and, for OLMoE, half of each q/k norm), serving the base model and two expert adapters in one batch, must reproduce
tp=1."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
from loraplex.protocol.config import ServerConfig
from loraplex.worker.model_runner import ModelRunner

from tests.lora_helpers import batch_logits, greedy_decode, load_all
from tests.moe_models import ARCHS, build_moe_set
from tests.worker_helpers import random_prompts, run_two_ranks, tp_group

DECODE_STEPS = 4
CHILD_TIMEOUT_S = 180
NAMES = [None, "a4", "a8", "a8", None]
LENGTHS = [6, 9, 4, 11, 5]


def tp_config(tp: int) -> ServerConfig:
    return ServerConfig(device="cpu", tp=tp, page_size=4, max_total_tokens=512, enable_lora=True, max_lora_rank=8,
                        lora_target_modules=["all"], max_loras_per_batch=3)  # fmt: skip


def run_moe(runner: ModelRunner, adapter_dirs: dict[str, str], lengths: list[int] = LENGTHS) -> dict:
    """The base model and the adapters a4, a8 in one batch (NAMES): every prompt's logits, then greedy steps."""
    load_all(runner, adapter_dirs)
    prompts = random_prompts(lengths, runner.vocab_size, seed=31)
    return {
        "logits": [t.numpy() for t in batch_logits(runner, prompts, NAMES)],  # numpy: tensors die with the child
        "greedy": greedy_decode(runner, prompts, NAMES, steps=DECODE_STEPS),
    }


def tp_child(rank: int, port: int, model_dir: str, adapter_dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        runner = ModelRunner(config, model_dir, rank, 2, "cpu")
        experts = runner.model.model.layers[0].mlp.experts
        shapes = (tuple(experts.gate_up_proj.base.weight.shape), tuple(experts.down_proj.base.weight.shape))
        results.put((rank, {**run_moe(runner, adapter_dirs), "shapes": shapes}))


def assert_ranks_match_tp1(by_rank: dict, tp1: dict, shapes: tuple) -> None:
    """Each rank held `shapes` (its shards) and gave tp=1's logits (to 1e-3) and greedy tokens."""
    for rank in (0, 1):
        assert by_rank[rank]["shapes"] == shapes, by_rank[rank]["shapes"]
        for name, ours, ref in zip(NAMES, by_rank[rank]["logits"], tp1["logits"], strict=True):
            diff = abs(ours - ref).max()
            assert diff <= 1e-3, (rank, name, diff)
        assert by_rank[rank]["greedy"] == tp1["greedy"], rank


@pytest.mark.parametrize("arch", ARCHS)
def test_moe_tp2_matches_tp1(arch: str, tmp_path: Path) -> None:
    model_dir, adapters = build_moe_set(tmp_path, arch)
    dirs = {name: str(path) for name, path in adapters.items()}
    by_rank = run_two_ranks(tp_child, str(model_dir), dirs, timeout_s=CHILD_TIMEOUT_S)
    tp1 = run_moe(ModelRunner(tp_config(tp=1), str(model_dir), 0, 1, "cpu"), dirs)
    # 4 experts of intermediate 96, half on each rank: gate_up (4, 2 * 48, 64), down (4, 64, 48)
    assert_ranks_match_tp1(by_rank, tp1, ((4, 96, 64), (4, 64, 48)))
