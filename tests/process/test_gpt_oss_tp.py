"""gpt-oss under tensor parallelism: two gloo ranks, each holding half of the heads (and their sinks) and half of
every expert's intermediate dimension (its biases: gate_up's rows split, down's added on rank 0 alone), plain or in
MXFP4 (down split by whole 32-input blocks), serving the base model and two adapters in one batch, must reproduce
tp=1."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
from loraplex.protocol.config import ServerConfig
from loraplex.worker.model_runner import ModelRunner

from tests.gpt_oss_models import build_gpt_oss_set
from tests.lora_helpers import batch_logits, greedy_decode, load_all
from tests.mxfp4_checkpoint import write_mxfp4
from tests.worker_helpers import random_prompts, run_two_ranks, tp_group

DECODE_STEPS = 4
CHILD_TIMEOUT_S = 180
NAMES = [None, "a4", "a8", "a8", None]
LENGTHS = [6, 9, 4, 11, 5]


def tp_config(tp: int) -> ServerConfig:
    return ServerConfig(device="cpu", tp=tp, page_size=4, max_total_tokens=512, enable_lora=True, max_lora_rank=8,
                        lora_target_modules=["all"], max_loras_per_batch=3)  # fmt: skip


def run_gpt_oss(runner: ModelRunner, adapter_dirs: dict[str, str]) -> dict:
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
        layer = runner.model.model.layers[0]
        gate_up, down = layer.mlp.experts.gate_up_proj.base, layer.mlp.experts.down_proj.base
        held = [(linear.blocks if linear.packed else linear.weight).shape for linear in (gate_up, down)]
        shapes = (*map(tuple, held), tuple(layer.self_attn.sinks.shape))
        results.put((rank, {**run_gpt_oss(runner, adapter_dirs), "shapes": shapes}))


@pytest.mark.parametrize("experts", ["plain", "mxfp4"])
def test_gpt_oss_tp2_matches_tp1(experts: str, tmp_path: Path) -> None:
    model_dir, adapters = build_gpt_oss_set(tmp_path)
    if experts == "mxfp4":
        write_mxfp4(model_dir, tmp_path / "mxfp4", tmp_path / "dequantized")
        model_dir = tmp_path / "mxfp4"
    dirs = {name: str(path) for name, path in adapters.items()}
    by_rank = run_two_ranks(tp_child, str(model_dir), dirs, timeout_s=CHILD_TIMEOUT_S)
    tp1 = run_gpt_oss(ModelRunner(tp_config(tp=1), str(model_dir), 0, 1, "cpu"), dirs)
    # 4 experts of intermediate 64 over hidden 64, half on each rank: gate_up 2 * 32 rows, down 32 inputs (MXFP4: in
    # code bytes, two inputs each); 2 of the 4 heads' sinks
    expected = ((4, 64, 64), (4, 64, 32), (2,)) if experts == "plain" else ((4, 64, 32), (4, 64, 16), (2,))
    for rank in (0, 1):
        assert by_rank[rank]["shapes"] == expected, by_rank[rank]["shapes"]
        for name, ours, ref in zip(NAMES, by_rank[rank]["logits"], tp1["logits"], strict=True):
            diff = abs(ours - ref).max()
            assert diff <= 1e-3, (rank, name, diff)
        assert by_rank[rank]["greedy"] == tp1["greedy"], rank
