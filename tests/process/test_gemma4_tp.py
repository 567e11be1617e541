"""Gemma 4 under tensor parallelism: two gloo ranks, each holding half of every layer's heads (the full layers' wider
and fewer KV heads too), of the dense MLPs and of every expert's intermediate dimension, serving the base model and
two adapters (attention only; attention, MLPs and the stacked experts) in one batch, must reproduce tp=1."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
from loraplex.worker.model_runner import ModelRunner

from tests.gemma4_models import build_gemma4_set
from tests.process.test_moe_tp import CHILD_TIMEOUT_S, assert_ranks_match_tp1, run_moe, tp_config
from tests.worker_helpers import run_two_ranks, tp_group

LENGTHS = [6, 19, 4, 13, 5]  # one prompt past the sliding window of 8


def tp_child(rank: int, port: int, model_dir: str, adapter_dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        runner = ModelRunner(config, model_dir, rank, 2, "cpu")
        layer = runner.model.model.layers[1]
        if hasattr(layer.mlp, "experts"):
            linears = (
                layer.mlp.experts.gate_up_proj,
                layer.mlp.experts.down_proj,
                layer.mlp.shared_experts.gate_up_proj,
            )
        else:
            linears = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.gate_up_proj)
        shapes = tuple(tuple(linear.base.weight.shape) for linear in linears)
        results.put((rank, {**run_moe(runner, adapter_dirs, LENGTHS), "shapes": shapes}))


@pytest.mark.parametrize(
    ("kind", "shapes"),
    [
        # the full layer 1: 4 heads of 24 and 2 KV heads, half on each rank; its MLP 2 * 48 rows, half each
        ("dense", ((48, 64), (24, 64), (48, 64))),
        # 4 experts of intermediate 32, half on each rank: gate_up (4, 2 * 16, 64), down (4, 64, 16); dense MLP 48
        ("moe", ((4, 32, 64), (4, 64, 16), (48, 64))),
    ],
)
def test_gemma4_tp2_matches_tp1(kind: str, shapes: tuple, tmp_path: Path) -> None:
    model_dir, adapters = build_gemma4_set(tmp_path, kind)
    dirs = {name: str(path) for name, path in adapters.items()}
    by_rank = run_two_ranks(tp_child, str(model_dir), dirs, timeout_s=CHILD_TIMEOUT_S)
    tp1 = run_moe(ModelRunner(tp_config(tp=1), str(model_dir), 0, 1, "cpu"), dirs, LENGTHS)
    assert_ranks_match_tp1(by_rank, tp1, shapes)
