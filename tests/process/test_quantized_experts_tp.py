"""Quantized MoE experts under tensor parallelism: two gloo ranks, each holding its shard of every expert in the
checkpoint's precision (FP8 rows of a 128x128 block both ranks share; AWQ and compressed-tensors INT4 columns in whole
groups of 16), or under expert parallelism half of the experts whole (AWQ INT4, FP8), serving the base model, an
attention-only adapter and an adapter on every expert in one batch, must reproduce tp=1."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import msgspec
import pytest
from loraplex.worker.model_runner import ModelRunner

from tests.process.test_moe_tp import CHILD_TIMEOUT_S, assert_ranks_match_tp1, run_moe, tp_config
from tests.quantized_moe import build_quantized_moe
from tests.worker_helpers import run_two_ranks, tp_group

# 4 experts, intermediate 96 (48 per rank), hidden 64: the stored values' shapes of gate_up and down on each rank
SHARD_SHAPES = {
    ("fp8-block", "tp"): ((4, 96, 64), (4, 64, 48)),  # FP8 values
    ("awq-4bit", "tp"): ((4, 96, 8), (4, 64, 6)),  # int32 words of 8 values along the input
    ("awq-4bit", "ep"): ((2, 192, 8), (2, 64, 12)),  # two experts whole
    ("ct-w4a16", "tp"): ((4, 96, 8), (4, 64, 6)),  # compressed-tensors' packed words, held as AWQ's
    ("fp8-block", "ep"): ((2, 192, 64), (2, 64, 96)),  # two experts whole, FP8 values
}


def stored_shapes(runner: ModelRunner) -> tuple[tuple[int, ...], ...]:
    experts = runner.model.model.layers[0].mlp.experts
    stacked = [linear.base.storage.stacked for linear in (experts.gate_up_proj, experts.down_proj)]
    return tuple(tuple(getattr(s, "q", getattr(s, "qweight", None)).shape) for s in stacked)


def tp_child(rank: int, port: int, model_dir: str, adapter_dirs: dict[str, str], expert_parallel: bool,
             results: mp.Queue) -> None:  # fmt: skip
    config = msgspec.structs.replace(tp_config(tp=2), enable_expert_parallel=expert_parallel)
    with tp_group(config, rank, port):
        runner = ModelRunner(config, model_dir, rank, 2, "cpu")
        results.put((rank, {**run_moe(runner, adapter_dirs), "shapes": stored_shapes(runner)}))


@pytest.mark.parametrize(("fmt", "mode"), sorted(SHARD_SHAPES))
def test_quantized_experts_tp2_match_tp1(fmt: str, mode: str, tmp_path: Path) -> None:
    checkpoints, adapters = build_quantized_moe(tmp_path, formats=(fmt,))
    model_dir = str(checkpoints[fmt][0])
    dirs = {name: str(path) for name, path in adapters.items()}
    by_rank = run_two_ranks(tp_child, model_dir, dirs, mode == "ep", timeout_s=CHILD_TIMEOUT_S)
    tp1 = run_moe(ModelRunner(tp_config(tp=1), model_dir, 0, 1, "cpu"), dirs)
    assert_ranks_match_tp1(by_rank, tp1, SHARD_SHAPES[fmt, mode])
