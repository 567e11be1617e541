"""Llama 4 under tensor parallelism: two gloo ranks, each holding half of the heads, of every expert's and the shared
expert's intermediate dimension and of the dense MLPs, serving the base model and two adapters (attention only;
attention, MLPs, shared experts and stacked experts) in one batch, must reproduce tp=1."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from loraplex.protocol.config import ServerConfig
from loraplex.worker.model_runner import ModelRunner

from tests.llama4_models import build_llama4_set
from tests.lora_helpers import batch_logits, greedy_decode, load_all
from tests.worker_helpers import random_prompts, run_two_ranks, tp_group

DECODE_STEPS = 4
CHILD_TIMEOUT_S = 180
NAMES = [None, "a4", "a8", "a8", None]
LENGTHS = [6, 9, 4, 13, 5]  # chunks of 6


def tp_config(tp: int) -> ServerConfig:
    return ServerConfig(device="cpu", tp=tp, page_size=4, max_total_tokens=512, enable_lora=True, max_lora_rank=8,
                        lora_target_modules=["all"], max_loras_per_batch=3)  # fmt: skip


def run_llama4(runner: ModelRunner, adapter_dirs: dict[str, str]) -> dict:
    load_all(runner, adapter_dirs)
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=31)
    return {
        "logits": [t.numpy() for t in batch_logits(runner, prompts, NAMES)],  # numpy: tensors die with the child
        "greedy": greedy_decode(runner, prompts, NAMES, steps=DECODE_STEPS),
    }


def tp_child(rank: int, port: int, model_dir: str, adapter_dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        runner = ModelRunner(config, model_dir, rank, 2, "cpu")
        mlp = runner.model.model.layers[1].mlp
        shapes = (tuple(mlp.experts.gate_up_proj.base.weight.shape), tuple(mlp.experts.down_proj.base.weight.shape),
                  tuple(mlp.shared_experts.gate_up_proj.base.weight.shape))  # fmt: skip
        results.put((rank, {**run_llama4(runner, adapter_dirs), "shapes": shapes}))


def test_llama4_tp2_matches_tp1(tmp_path: Path) -> None:
    model_dir, adapters = build_llama4_set(tmp_path)
    dirs = {name: str(path) for name, path in adapters.items()}
    by_rank = run_two_ranks(tp_child, str(model_dir), dirs, timeout_s=CHILD_TIMEOUT_S)
    tp1 = run_llama4(ModelRunner(tp_config(tp=1), str(model_dir), 0, 1, "cpu"), dirs)
    for rank in (0, 1):
        # 4 experts of intermediate 48, half on each rank: gate_up (4, 2 * 24, 64), down (4, 64, 24); shared (48, 64)
        assert by_rank[rank]["shapes"] == ((4, 48, 64), (4, 64, 24), (48, 64)), by_rank[rank]["shapes"]
        for name, ours, ref in zip(NAMES, by_rank[rank]["logits"], tp1["logits"], strict=True):
            diff = abs(ours - ref).max()
            assert diff <= 1e-3, (rank, name, diff)
        assert by_rank[rank]["greedy"] == tp1["greedy"], rank
