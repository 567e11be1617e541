"""Qwen3.5-MoE and Qwen3-Next with two adapters under tensor parallelism: two gloo ranks (DeltaNet heads, conv
channels, A_log and dt_bias split; Qwen3-Next's grouped projections regrouped, then split; out_proj row-parallel;
attention heads split; the routed experts' and Qwen3.5-MoE's shared expert's LoRA cut as their MLPs) must reproduce
tp=1 on a batch mixing the base model and both adapters, and on a schedule of chunked prefills beside decodes (each
rank keeps its heads' states), and across a prefix-cache hit (each rank saves and restores its heads' share of a
state snapshot)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, SlotLoad
from loraplex.worker.model_runner import ModelRunner

from tests.hybrid_models import ADAPTERS, build_hybrid_adapter, build_hybrid_model
from tests.worker_helpers import (
    GREEDY,
    Seq,
    consecutive_pages,
    forward_logits,
    random_prompts,
    run_greedy_schedule,
    run_two_ranks,
    tp_group,
)

LORA_IDS = {"all": 1, "linear": 2}
SLOT_LOADS = [SlotLoad(slot=slot, lora_id=LORA_IDS[name]) for slot, name in enumerate(LORA_IDS)]
MIXED = [None, None, "all", "all", "linear", "linear"]  # grouped by slot, as the scheduler sends them
LENGTHS = [6, 70, 4, 11, 9, 5]


def tp_config(tp: int) -> ServerConfig:
    return ServerConfig(device="cpu", tp=tp, page_size=4, max_total_tokens=512, enable_lora=True, max_lora_rank=8,
                        lora_target_modules=["all"], max_loras_per_batch=2, max_running_requests=8)  # fmt: skip


def run_mixed(runner: ModelRunner, adapter_dirs: dict[str, str]) -> dict:
    specs = [AdapterToLoad(lora_name=n, lora_path=p, lora_id=LORA_IDS[n]) for n, p in adapter_dirs.items()]
    assert all(r.success for r in runner.lora.load(specs))
    slots = [-1 if name is None else list(LORA_IDS).index(name) for name in MIXED]
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=51)
    pages = consecutive_pages(LENGTHS, runner.page_size)
    reqs = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=s, state_slot=i)
            for i, (p, pg, s) in enumerate(zip(prompts, pages, slots, strict=True))]  # fmt: skip
    logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=SLOT_LOADS))
    seqs = [Seq(prompt=p, prefill_chunk=c, slot=s, state_slot=i)
            for i, (p, c, s) in enumerate(zip(random_prompts([13, 9, 17], runner.vocab_size, seed=52), [5, 3, 100],
                                              [-1, 0, 1], strict=True))]  # fmt: skip
    greedy = run_greedy_schedule(runner, seqs, start_steps=[0, 1, 2], max_new_tokens=6)
    # A saves its states at 8, inside its pass; B shares A's first two pages and restores the snapshot.
    prompt = random_prompts([15], runner.vocab_size, seed=53)[0]
    saving = ForwardReq(input_ids=prompt[:11], num_cached_tokens=0, page_ids=[100, 101, 102], sampling=GREEDY,
                        slot=0, state_slot=6, snapshot_saves=[(8, 0)])  # fmt: skip
    runner.forward(ForwardBatch(batch_id=1, reqs=[saving]))
    restoring = ForwardReq(input_ids=prompt[8:], num_cached_tokens=8, page_ids=[100, 101, 110, 111], sampling=GREEDY,
                           slot=0, state_slot=7, restore_snapshot=0)  # fmt: skip
    restored = forward_logits(runner, ForwardBatch(batch_id=2, reqs=[restoring]))
    return {"logits": logits.numpy(), "greedy": greedy, "restored": restored.numpy()}


def tp_child(rank: int, port: int, model_dir: str, adapter_dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        runner = ModelRunner(config, model_dir, rank, 2, "cpu")
        gdn = runner.model.model.layers[0].linear_attn
        qkv = getattr(gdn, "in_proj_qkv", None) or gdn.in_proj_qkvz
        shapes = {"qkv": qkv.base.output_sizes_per_rank[:3], "conv": tuple(gdn.conv1d.weight.shape),
                  "recurrent": tuple(runner.kv_cache.recurrent.shape)}  # fmt: skip
        results.put((rank, {**run_mixed(runner, adapter_dirs), **shapes}))


@pytest.mark.parametrize("arch", ["qwen3_5_moe_text", "qwen3_next"])
def test_hybrid_lora_tp2_matches_tp1(arch: str, tmp_path: Path) -> None:
    hybrid_dir = tmp_path / arch
    build_hybrid_model(hybrid_dir, arch=arch)
    dirs = {}
    for seed, name in enumerate(ADAPTERS):
        dirs[name] = str(tmp_path / name)
        build_hybrid_adapter(hybrid_dir, dirs[name], name, seed=seed, arch=arch,
                             experts=name == "all" and arch != "qwen3_5_text")  # fmt: skip
    by_rank = run_two_ranks(tp_child, str(hybrid_dir), dirs, timeout_s=240)
    tp1 = run_mixed(ModelRunner(tp_config(tp=1), str(hybrid_dir), 0, 1, "cpu"), dirs)
    for rank in (0, 1):
        assert by_rank[rank]["qkv"] == [8, 8, 16]  # one of 2 key heads (dk 8) for q and k, 2 of 4 value heads
        assert by_rank[rank]["conv"] == (32, 1, 4)
        assert by_rank[rank]["recurrent"] == (3, 8, 2, 8, 8)  # 3 layers, 8 slots, 2 value heads here
        for name in ("logits", "restored"):
            diff = abs(by_rank[rank][name] - tp1[name]).max()
            assert diff <= 1e-3, (rank, name, diff)  # logits up to ~10: fp32 sums in another order
        assert by_rank[rank]["greedy"] == tp1["greedy"], rank
