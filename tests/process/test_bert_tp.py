"""BERT under tensor parallelism: two gloo ranks, each with half of the heads (query/key/value by head, the attention
output and the MLP's down projection by their input, the MLP's up projection by its output), embeddings, norms and
the cross-encoder's head whole; the base model and two adapters on every encoder linear in one batch (a pair's
second segment included) must reproduce tp=1: every token's last hidden state and each pair's score."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import torch
from loraplex.protocol.structs import ForwardBatch, ForwardReq
from loraplex.worker.model_runner import ModelRunner

from tests.lora_helpers import load_all, slot_loads, slot_of
from tests.process.test_moe_tp import CHILD_TIMEOUT_S, tp_config
from tests.worker_helpers import GREEDY, consecutive_pages, random_prompts, run_two_ranks, tp_group

NAMES = [None, "a8", "a4", "a8", None]
LENGTHS = [6, 11, 3, 8, 5]
TOL = 1e-4


@torch.inference_mode()
def run_bert(runner: ModelRunner, adapter_dirs: dict[str, str]) -> dict:
    """The mixed batch's hidden states (tokens, hidden) and pooled scores (seqs, 1), as numpy (tensors die with a
    child)."""
    load_all(runner, adapter_dirs)
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=7)
    pages = consecutive_pages(LENGTHS, runner.page_size)
    reqs = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=slot_of(n), pool=True,
                       token_type_ids=[0] * (len(p) // 2) + [1] * (len(p) - len(p) // 2))
            for p, pg, n in zip(prompts, pages, NAMES, strict=True)]  # fmt: skip
    hidden, _ = runner.hidden_states(reqs, slot_loads(NAMES))
    scores = runner.step(ForwardBatch(batch_id=0, reqs=reqs)).pooled
    qkv = runner.model.model.layers[0].self_attn.qkv_proj.base.weight
    return {"hidden": hidden.numpy(), "scores": np.stack([np.frombuffer(row, dtype="<f4") for row in scores]),
            "qkv_shape": tuple(qkv.shape)}  # fmt: skip


def tp_child(rank: int, port: int, model_dir: str, adapter_dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        results.put((rank, run_bert(ModelRunner(config, model_dir, rank, 2, "cpu"), adapter_dirs)))


def test_bert_tp2_matches_tp1(bert_cross_encoder: tuple[Path, dict[str, Path]]) -> None:
    model_dir, adapters = bert_cross_encoder
    dirs = {name: str(path) for name, path in adapters.items()}
    by_rank = run_two_ranks(tp_child, str(model_dir), dirs, timeout_s=CHILD_TIMEOUT_S)
    tp1 = run_bert(ModelRunner(tp_config(tp=1), str(model_dir), 0, 1, "cpu"), dirs)
    assert tp1["qkv_shape"] == (3 * 64, 64)
    for rank in (0, 1):
        assert by_rank[rank]["qkv_shape"] == (3 * 32, 64)  # 2 of 4 heads of q, k and v
        assert np.abs(by_rank[rank]["hidden"] - tp1["hidden"]).max() <= TOL, rank
        assert np.abs(by_rank[rank]["scores"] - tp1["scores"]).max() <= TOL, rank
    assert np.abs(tp1["scores"]).min() > 0  # a head that loaded (a zero classifier would pass anything)
