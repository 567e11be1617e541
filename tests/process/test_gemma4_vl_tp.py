"""Gemma 4 with images under tensor parallelism: two gloo ranks (the vision tower's heads and MLP split like the
language model's, and with them a tower adapter's A and B; the embedder replicated) reproduce tp=1 on a batch of
prompts with images and without, the base model, two language-model adapters and one on the tower too, prefill and
greedy decode."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import ForwardBatch, ForwardReq
from loraplex.worker.model_runner import ModelRunner

from tests.gemma4_vision_models import TOWER_LORA, build_gemma4_vl_set, inputs, request
from tests.lora_helpers import load_all, slot_loads, slot_of
from tests.worker_helpers import GREEDY, consecutive_pages, forward_logits, run_two_ranks, tp_group

DECODE_STEPS = 3
MIXED = [("one", None), ("two", "a4"), ("text", "a8"), ("two", "a16")]


def tp_config(tp: int) -> ServerConfig:
    return ServerConfig(device="cpu", tp=tp, page_size=4, max_total_tokens=1024, **TOWER_LORA)


@torch.inference_mode()
def run_mixed(runner: ModelRunner, adapter_dirs: dict[str, str]) -> dict:
    load_all(runner, adapter_dirs)
    prompts = [inputs(key) for key, _ in MIXED]
    names = [name for _, name in MIXED]
    lengths = [p["input_ids"].shape[1] for p in prompts]
    pages = consecutive_pages([n + DECODE_STEPS for n in lengths], runner.page_size)
    reqs = [request(p, pg, name, key=i) for i, (p, pg, name) in enumerate(zip(prompts, pages, names, strict=True))]
    logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=slot_loads(names)))
    outputs = [[t] for t in runner.forward(ForwardBatch(batch_id=1, reqs=reqs))]  # the same prefill, sampled
    for step in range(1, DECODE_STEPS):
        steps = [ForwardReq(input_ids=out[-1:], num_cached_tokens=n + step - 1, page_ids=pg, num_generated=step,
                            slot=slot_of(name), req_key=i, sampling=GREEDY)
                 for i, (out, n, pg, name) in enumerate(zip(outputs, lengths, pages, names, strict=True))]
        for out, token in zip(outputs, runner.forward(ForwardBatch(batch_id=1 + step, reqs=steps)), strict=True):
            out.append(token)
    # numpy: tensors would cross processes as shared memory that dies with the child
    attn = runner.model.vision_tower.encoder.layers[0].self_attn
    return {"logits": logits.numpy(), "greedy": outputs,
            "q_rows": attn.q_proj.linear.base.output_sizes_per_rank}  # fmt: skip


def tp_child(rank: int, port: int, model_dir: str, adapter_dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        results.put((rank, run_mixed(ModelRunner(config, model_dir, rank, 2, "cpu"), adapter_dirs)))


@pytest.fixture(scope="module")
def vl_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    return build_gemma4_vl_set(tmp_path_factory.mktemp("gemma4_vl_tp"), tower=True)


def test_gemma4_vl_tp2_matches_tp1(vl_set) -> None:
    model_dir, adapters = vl_set
    dirs = {name: str(path) for name, path in adapters.items()}
    by_rank = run_two_ranks(tp_child, str(model_dir), dirs, timeout_s=180)
    tp1 = run_mixed(ModelRunner(tp_config(tp=1), str(model_dir), 0, 1, "cpu"), dirs)
    for rank in (0, 1):
        assert by_rank[rank]["q_rows"] == [16]  # one of the tower's two heads (width 16) each
        diff = abs(by_rank[rank]["logits"] - tp1["logits"]).max()
        # fp32 sums split over two ranks add in another order; the logits here are ~10 in magnitude
        assert diff <= 3e-4, (rank, diff)
        assert by_rank[rank]["greedy"] == tp1["greedy"], rank
