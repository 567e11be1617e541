"""DeepSeek-V3 under tensor parallelism: two gloo ranks, each with half of the heads (q_b_proj and kv_b_proj by head,
o_proj by its input), the latent and rope key replicated, half of every expert; the base model and two adapters on
every latent-attention linear and the experts in one batch must reproduce tp=1."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from loraplex.worker.model_runner import ModelRunner

from tests.lora_helpers import batch_logits, mixed_prefill_decode_logits
from tests.mla_models import build_mla_expert_adapter, build_mla_set
from tests.process.test_moe_tp import CHILD_TIMEOUT_S, NAMES, run_moe, tp_config
from tests.worker_helpers import random_prompts, run_two_ranks, tp_group


def run_mla(runner: ModelRunner, adapter_dirs: dict[str, str]) -> dict:
    """run_moe's batch and decode on a4 and a8 (prefills in the expanded form, decodes in the absorbed one), one batch
    of both forms, then a16 (the shared experts' and dense MLP's LoRA too) beside the base model."""
    results = run_moe(runner, adapter_dirs)
    results["mixed"] = [t.numpy() for t in mixed_prefill_decode_logits(runner)[3]]
    prompts = random_prompts([7, 5], runner.vocab_size, seed=33)
    results["mlps"] = [t.numpy() for t in batch_logits(runner, prompts, ["a16", None])]
    return results


def tp_child(rank: int, port: int, model_dir: str, adapter_dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        runner = ModelRunner(config, model_dir, rank, 2, "cpu")
        attn = runner.model.model.layers[1].self_attn
        shapes = (
            tuple(attn.kv_b_proj.base.weight.shape),
            tuple(attn.q_b_proj.base.weight.shape),
            tuple(attn.kv_a_proj_with_mqa.base.weight.shape),
            tuple(runner.kv_cache.kv.shape[-2:]),
        )
        results.put((rank, {**run_mla(runner, adapter_dirs), "shapes": shapes}))


def test_deepseek_v3_tp2_matches_tp1(tmp_path: Path) -> None:
    model_dir, adapters = build_mla_set(tmp_path)
    build_mla_expert_adapter(model_dir, tmp_path / "a16", r=4, lora_alpha=8, seed=5, with_mlps=True)
    dirs = {**{name: str(path) for name, path in adapters.items()}, "a16": str(tmp_path / "a16")}
    by_rank = run_two_ranks(tp_child, str(model_dir), dirs, timeout_s=CHILD_TIMEOUT_S)
    tp1 = run_mla(ModelRunner(tp_config(tp=1), str(model_dir), 0, 1, "cpu"), dirs)
    for rank in (0, 1):
        # 2 of 4 heads: kv_b (2 * (16 + 12), 32), q_b (2 * 24, 24); kv_a whole (32 + 8, 64); one cache head of 40
        assert by_rank[rank]["shapes"] == ((56, 32), (48, 24), (40, 64), (1, 40)), by_rank[rank]["shapes"]
        for name, ours, ref in zip(NAMES, by_rank[rank]["logits"], tp1["logits"], strict=True):
            diff = abs(ours - ref).max()
            assert diff <= 1e-3, (rank, name, diff)
        assert by_rank[rank]["greedy"] == tp1["greedy"], rank
        for ours, ref in zip(by_rank[rank]["mixed"] + by_rank[rank]["mlps"], tp1["mixed"] + tp1["mlps"], strict=True):
            assert abs(ours - ref).max() <= 1e-3, rank
