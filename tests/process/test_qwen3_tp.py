"""Qwen3 with two adapters under tensor parallelism: two gloo ranks (q/k norms replicated, heads split) must
reproduce tp=1 on a batch mixing the base model and both adapters."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, SlotLoad
from loraplex.worker.model_runner import ModelRunner

from tests.worker_helpers import (
    GREEDY,
    consecutive_pages,
    decode,
    forward_logits,
    random_prompts,
    run_two_ranks,
    tp_group,
)

DECODE_STEPS = 6
LORA_IDS = {"q8": 1, "q16": 2}
MIXED = [None, "q8", "q16", None, "q8", "q16"]
LENGTHS = [6, 9, 4, 11, 7, 5]
SLOT_LOADS = [SlotLoad(slot=slot, lora_id=LORA_IDS[name]) for slot, name in enumerate(LORA_IDS)]


def tp_config(tp: int) -> ServerConfig:
    return ServerConfig(device="cpu", tp=tp, page_size=4, max_total_tokens=512, enable_lora=True, max_lora_rank=16,
                        lora_target_modules=["all"], max_loras_per_batch=2)  # fmt: skip


def run_mixed(runner: ModelRunner, adapter_dirs: dict[str, str]) -> dict:
    specs = [AdapterToLoad(lora_name=n, lora_path=p, lora_id=LORA_IDS[n]) for n, p in adapter_dirs.items()]
    assert all(r.success for r in runner.lora.load(specs))
    slots = [-1 if name is None else list(LORA_IDS).index(name) for name in MIXED]
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=51)
    pages = consecutive_pages(LENGTHS, runner.page_size)
    reqs = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=s)
            for p, pg, s in zip(prompts, pages, slots, strict=True)]  # fmt: skip
    logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=SLOT_LOADS))
    return {
        "logits": logits.numpy(),  # numpy: tensors would cross processes as shared memory that dies with the child
        "greedy": decode(runner, prompts, [GREEDY] * len(prompts), DECODE_STEPS, slots=slots, slot_loads=SLOT_LOADS),
    }


def tp_child(rank: int, port: int, model_dir: str, adapter_dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        runner = ModelRunner(config, model_dir, rank, 2, "cpu")
        heads = runner.model.model.layers[0].self_attn.qkv_proj.base.output_sizes_per_rank
        results.put((rank, {**run_mixed(runner, adapter_dirs), "qkv_per_rank": heads}))


def test_qwen3_lora_tp2_matches_tp1(qwen3_dir: Path, qwen3_adapter_dirs: dict[str, Path]) -> None:
    dirs = {name: str(path) for name, path in qwen3_adapter_dirs.items()}
    by_rank = run_two_ranks(tp_child, str(qwen3_dir), dirs, timeout_s=120)
    tp1 = run_mixed(ModelRunner(tp_config(tp=1), str(qwen3_dir), 0, 1, "cpu"), dirs)
    for rank in (0, 1):
        assert by_rank[rank]["qkv_per_rank"] == [64, 32, 32]  # half of q (4 x 32) and of k, v (2 x 32) each
        diff = abs(by_rank[rank]["logits"] - tp1["logits"]).max()
        assert diff <= 1e-4, (rank, diff)
        assert by_rank[rank]["greedy"] == tp1["greedy"], rank
