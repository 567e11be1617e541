"""GLM-4.5 under tensor parallelism: two gloo ranks, each with half of the q and KV heads (q/k/v biases cut with
them, the per-head q/k norms whole), half of every routed expert's and of the shared experts' and dense MLP's
intermediate dimension; the base model and two adapters (attention alone; attention, experts, shared experts and
dense MLP) in one batch must reproduce tp=1."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from loraplex.worker.model_runner import ModelRunner

from tests.glm4_moe_models import build_glm4_moe_set
from tests.process.test_moe_tp import CHILD_TIMEOUT_S, assert_ranks_match_tp1, run_moe, tp_config
from tests.worker_helpers import run_two_ranks, tp_group


def tp_child(rank: int, port: int, model_dir: str, adapter_dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        runner = ModelRunner(config, model_dir, rank, 2, "cpu")
        layer = runner.model.model.layers[1]
        shapes = (
            tuple(layer.self_attn.qkv_proj.base.bias.shape),
            tuple(layer.mlp.experts.down_proj.base.weight.shape),
            tuple(layer.mlp.shared_experts.gate_up_proj.base.weight.shape),
            tuple(runner.kv_cache.kv.shape[-2:]),
        )
        results.put((rank, {**run_moe(runner, adapter_dirs), "shapes": shapes}))


def test_glm4_moe_tp2_matches_tp1(tmp_path: Path) -> None:
    model_dir, adapters = build_glm4_moe_set(tmp_path)
    dirs = {name: str(path) for name, path in adapters.items()}
    by_rank = run_two_ranks(tp_child, str(model_dir), dirs, timeout_s=CHILD_TIMEOUT_S)
    tp1 = run_moe(ModelRunner(tp_config(tp=1), str(model_dir), 0, 1, "cpu"), dirs)
    # 2 of 4 q heads and 1 of 2 KV heads of 16: qkv bias 32 + 16 + 16; 8 experts' down (64, 32 / 2); the shared
    # experts' gate_up (2 * 32 / 2, 64); one KV head of 16 in the cache
    assert_ranks_match_tp1(by_rank, tp1, ((64,), (8, 64, 16), (32, 64), (1, 16)))
