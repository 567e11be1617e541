"""gpt-oss under tensor parallelism: two gloo ranks, each holding half of the heads (and their sinks) and half of
every expert's intermediate dimension (its biases: gate_up's rows split, down's added on rank 0 alone), plain or in
MXFP4 (down split by whole 32-input blocks), serving the base model and two adapters in one batch, must reproduce
tp=1."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
from loraplex.worker.model_runner import ModelRunner

from tests.gpt_oss_models import build_gpt_oss_set
from tests.mxfp4_checkpoint import write_mxfp4
from tests.process.test_moe_tp import CHILD_TIMEOUT_S, assert_ranks_match_tp1, run_moe, tp_config
from tests.worker_helpers import run_two_ranks, tp_group


def tp_child(rank: int, port: int, model_dir: str, adapter_dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        runner = ModelRunner(config, model_dir, rank, 2, "cpu")
        layer = runner.model.model.layers[0]
        gate_up, down = layer.mlp.experts.gate_up_proj.base, layer.mlp.experts.down_proj.base
        held = [(linear.blocks if linear.packed else linear.weight).shape for linear in (gate_up, down)]
        shapes = (*map(tuple, held), tuple(layer.self_attn.sinks.shape))
        results.put((rank, {**run_moe(runner, adapter_dirs), "shapes": shapes}))


@pytest.mark.parametrize("experts", ["plain", "mxfp4"])
def test_gpt_oss_tp2_matches_tp1(experts: str, tmp_path: Path) -> None:
    model_dir, adapters = build_gpt_oss_set(tmp_path)
    if experts == "mxfp4":
        write_mxfp4(model_dir, tmp_path / "mxfp4", tmp_path / "dequantized")
        model_dir = tmp_path / "mxfp4"
    dirs = {name: str(path) for name, path in adapters.items()}
    by_rank = run_two_ranks(tp_child, str(model_dir), dirs, timeout_s=CHILD_TIMEOUT_S)
    tp1 = run_moe(ModelRunner(tp_config(tp=1), str(model_dir), 0, 1, "cpu"), dirs)
    # 4 experts of intermediate 64 over hidden 64, half on each rank: gate_up 2 * 32 rows, down 32 inputs (MXFP4: in
    # code bytes, two inputs each); 2 of the 4 heads' sinks
    expected = ((4, 64, 64), (4, 64, 32), (2,)) if experts == "plain" else ((4, 64, 32), (4, 64, 16), (2,))
    assert_ranks_match_tp1(by_rank, tp1, expected)
