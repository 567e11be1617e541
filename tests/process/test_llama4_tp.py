"""Llama 4 under tensor parallelism: two gloo ranks, each holding half of the heads, of every expert's and the shared
expert's intermediate dimension and of the dense MLPs, serving the base model and two adapters (attention only;
attention, MLPs, shared experts and stacked experts) in one batch, must reproduce tp=1."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from loraplex.worker.model_runner import ModelRunner

from tests.llama4_models import build_llama4_set
from tests.process.test_moe_tp import CHILD_TIMEOUT_S, assert_ranks_match_tp1, run_moe, tp_config
from tests.worker_helpers import run_two_ranks, tp_group

LENGTHS = [6, 9, 4, 13, 5]  # chunks of 6: one prompt crosses two


def tp_child(rank: int, port: int, model_dir: str, adapter_dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        runner = ModelRunner(config, model_dir, rank, 2, "cpu")
        mlp = runner.model.model.layers[1].mlp
        shapes = (tuple(mlp.experts.gate_up_proj.base.weight.shape), tuple(mlp.experts.down_proj.base.weight.shape),
                  tuple(mlp.shared_experts.gate_up_proj.base.weight.shape))  # fmt: skip
        results.put((rank, {**run_moe(runner, adapter_dirs, LENGTHS), "shapes": shapes}))


def test_llama4_tp2_matches_tp1(tmp_path: Path) -> None:
    model_dir, adapters = build_llama4_set(tmp_path)
    dirs = {name: str(path) for name, path in adapters.items()}
    by_rank = run_two_ranks(tp_child, str(model_dir), dirs, timeout_s=CHILD_TIMEOUT_S)
    tp1 = run_moe(ModelRunner(tp_config(tp=1), str(model_dir), 0, 1, "cpu"), dirs, LENGTHS)
    # 4 experts of intermediate 48, half on each rank: gate_up (4, 2 * 24, 64), down (4, 64, 24); shared (48, 64)
    assert_ranks_match_tp1(by_rank, tp1, ((4, 48, 64), (4, 64, 24), (48, 64)))
