"""Tensor parallelism: two gloo ranks on loopback must reproduce the single-process model."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import SamplingParams
from loraplex.worker.model_runner import ModelRunner

from tests.worker_helpers import (
    GREEDY,
    build_llama_variant,
    decode,
    prefill_logits,
    random_prompts,
    run_two_ranks,
    tp_group,
)

PROMPT_LENGTHS = [6, 11, 3, 17]
DECODE_STEPS = 6
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
# Penalties read each request's tokens so far, which every rank keeps for itself.
PENALISED = SamplingParams(temperature=1.0, min_p=0.05, seed=5, repetition_penalty=0.3, frequency_penalty=-1.0)
CHILD_TIMEOUT_S = 120


def tp_config(tp: int) -> ServerConfig:
    # No max_total_tokens: the ranks size the KV cache themselves and must agree (all-reduce MIN).
    return ServerConfig(device="cpu", tp=tp, page_size=4, max_running_requests=4, context_length=64)


def run_model(runner: ModelRunner) -> dict:
    prompts = random_prompts(PROMPT_LENGTHS, runner.vocab_size, seed=3)
    return {
        # numpy, not tensors: torch sends tensors between processes as shared memory handles that die with the child.
        "logits": [prefill_logits(runner, p).numpy() for p in prompts],
        "greedy": decode(runner, prompts, [GREEDY] * len(prompts), steps=DECODE_STEPS),
        "seeded": decode(runner, prompts, [SEEDED] * len(prompts), steps=DECODE_STEPS),
        "penalised": decode(runner, prompts, [PENALISED] * len(prompts), steps=DECODE_STEPS),
        "max_total_tokens": runner.max_total_tokens,
    }


def tp_child(rank: int, port: int, model_dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        out = {kind: run_model(ModelRunner(config, path, rank, 2, "cpu")) for kind, path in model_dirs.items()}
        results.put((rank, out))


def run_tp2(model_dirs: dict[str, str]) -> dict[int, dict]:
    return run_two_ranks(tp_child, model_dirs, timeout_s=CHILD_TIMEOUT_S)


def test_tp2_matches_tp1(llama_dir: Path, qwen2_dir: Path, tmp_path: Path) -> None:
    # llama_bias has biases on o_proj and down_proj: a row-parallel bias must be added once, after the all-reduce.
    build_llama_variant(tmp_path / "llama_bias", attention_bias=True, mlp_bias=True)
    model_dirs = {"llama": str(llama_dir), "qwen2": str(qwen2_dir), "llama_bias": str(tmp_path / "llama_bias")}
    by_rank = run_tp2(model_dirs)
    for kind, path in model_dirs.items():
        tp1 = run_model(ModelRunner(tp_config(tp=1), path, 0, 1, "cpu"))
        for rank in (0, 1):
            tp2 = by_rank[rank][kind]
            for ours, ref in zip(tp2["logits"], tp1["logits"], strict=True):
                assert abs(ours - ref).max() <= 1e-4, (kind, rank)
            assert tp2["greedy"] == tp1["greedy"], (kind, rank)
            assert tp2["seeded"] == tp1["seeded"], (kind, rank)
            assert tp2["penalised"] == tp1["penalised"], (kind, rank)
            assert tp2["max_total_tokens"] == tp1["max_total_tokens"] == 256
