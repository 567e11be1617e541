"""Multi-LoRA under tensor parallelism: two gloo ranks serving one batch of five adapters must reproduce tp=1; so must
speculative decoding (n-gram drafts, a draft model with a draft adapter, an EAGLE-3 head) over the base and two
adapters."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import torch
import torch.distributed as dist
from loraplex.frontend.adapters.files import encode_tensors, read_adapter_tensors
from loraplex.frontend.adapters.mix_merge import merge
from loraplex.protocol.adapters.adapter_config import parse_adapter_config
from loraplex.protocol.adapters.lora_targets import ATTN_MODULES, TARGET_MODULES
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, InlineAdapter, SlotLoad
from loraplex.worker.lora.adapter import PoolSpec, load_adapter
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model_runner import ModelRunner
from safetensors.torch import load_file

from tests.builders import build_eagle3_head, build_lora_adapter
from tests.lora_helpers import (
    ADAPTER_IDS,
    LORA_CONFIG,
    MIXED,
    MIXED_LENGTHS,
    batch_logits,
    build_peft_adapter,
    greedy_decode,
    load_all,
)
from tests.speculative_helpers import MIXED_NAMES, generate, mixed_prompts
from tests.worker_helpers import GREEDY, consecutive_pages, forward_logits, random_prompts, run_two_ranks, tp_group

DECODE_STEPS = 6
SCALES = [1.0, 0.5, 0.0, 4.0, 1.0, 0.25, 1.0, 2.0, 1.5]  # per MIXED row (its base rows stay at 1)
MIX_ID, MIX_SLOT = 9, 5  # a slot lora_helpers' adapters leave free
COPIES_ID, COPIES_TOKENS = 10, [3, 5, 7]  # an adapter with an lm_head copy and trainable tokens, then in MIX_SLOT
CHILD_TIMEOUT_S = 240


def tp_config(tp: int) -> ServerConfig:
    return ServerConfig(device="cpu", tp=tp, page_size=4, max_total_tokens=512, **LORA_CONFIG)


def mix_logits(runner: ModelRunner, adapter_dirs: dict[str, str], prompts: list[list[int]]) -> list:
    """A linear lora_mix of a16 and b16, loaded as the frontend loads one (its whole tensors, each rank cutting its
    shard), in one batch: on the mix, on the mix at strength 0.5, on the base model."""
    parts = []
    for name in ("a16", "b16"):
        config, tensors = read_adapter_tensors(adapter_dirs[name], None)
        parts.append((parse_adapter_config(config), tensors))
    config, tensors = merge(parts, [0.7, -0.4], "linear", 1.0, 0)
    specs, buffers = encode_tensors(tensors)
    inline = InlineAdapter(config=config, tensors=specs)
    [outcome] = runner.lora.load([AdapterToLoad(lora_name="mix", lora_path=None, lora_id=MIX_ID, inline=inline)],
                                 buffers)  # fmt: skip
    assert outcome.success, outcome.error_message
    pages = consecutive_pages([len(p) for p in prompts], runner.page_size)
    reqs = [
        ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=slot, lora_scale=scale)
        for p, pg, slot, scale in zip(prompts, pages, (MIX_SLOT, MIX_SLOT, -1), (1.0, 0.5, 1.0), strict=True)
    ]
    batch = ForwardBatch(batch_id=50, reqs=reqs, slot_loads=[SlotLoad(slot=MIX_SLOT, lora_id=MIX_ID)])
    return [t.numpy() for t in forward_logits(runner, batch).split([len(p) for p in prompts])]


def copies_logits(runner: ModelRunner, adapter_dir: str, prompts: list[list[int]]) -> list:
    """An adapter carrying a full lm_head copy (modules_to_save) and trainable tokens, beside the base model on the
    same prompt: both layers are whole on every rank, and so are its copy and rows."""
    [outcome] = runner.lora.load([AdapterToLoad(lora_name="copies", lora_path=adapter_dir, lora_id=COPIES_ID)])
    assert outcome.success, outcome.error_message
    prompts = [p[:1] + COPIES_TOKENS + p[4:] for p in prompts]
    pages = consecutive_pages([len(p) for p in prompts], runner.page_size)
    reqs = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=slot)
            for p, pg, slot in zip(prompts, pages, (MIX_SLOT, -1), strict=True)]  # fmt: skip
    batch = ForwardBatch(batch_id=51, reqs=reqs, slot_loads=[SlotLoad(slot=MIX_SLOT, lora_id=COPIES_ID)])
    return [t.numpy() for t in forward_logits(runner, batch).split([len(p) for p in prompts])]


def run_lora(runner: ModelRunner, adapter_dirs: dict[str, str]) -> dict:
    """The mixed batches; a mix and a module-copies adapter where adapter_dirs holds "b16" and "copies"."""
    load_all(runner, adapter_dirs)
    prompts = random_prompts(MIXED_LENGTHS, runner.vocab_size, seed=21)
    extra = {}
    if "b16" in adapter_dirs:
        extra["mix"] = mix_logits(runner, adapter_dirs, prompts[:3])
    if "copies" in adapter_dirs:
        extra["copies"] = copies_logits(runner, adapter_dirs["copies"], [prompts[3], prompts[3]])
    return {
        **extra,
        # numpy, not tensors: torch sends tensors between processes as shared memory handles that die with the child.
        "logits": [t.numpy() for t in batch_logits(runner, prompts, MIXED)],
        # each adapter row at its own strength (lora_scale), 0 and up to the limit of 4 among them
        "scaled": [t.numpy() for t in batch_logits(runner, prompts, MIXED, SCALES)],
        "greedy": greedy_decode(runner, prompts, MIXED, steps=DECODE_STEPS),
    }


def count_collectives(runner: ModelRunner) -> dict[str, int]:
    """From now on, count the model's forward passes and the all-reduces (torch.distributed's, whoever calls it)."""
    counts = {"forwards": 0, "all_reduces": 0}
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        counts["all_reduces"] += 1
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce  # this child process only
    runner.model.register_forward_pre_hook(lambda *_: counts.__setitem__("forwards", counts["forwards"] + 1))
    return counts


def speculative_outputs(model_dir: str, adapter_dirs: dict[str, str], rank: int) -> dict:
    """Speculative decoding at TP=2, base + a4 + a8 in one batch: n-gram drafts, a draft model (the target itself, whole
    on every rank) with a8's draft adapter, and an EAGLE-3 head (reading the all-reduced hidden states of three
    layers); each rank's greedy outputs and its per-adapter draft counts."""
    adapters = {name: adapter_dirs[name] for name in ("a4", "a8")}
    out = {}
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    draft_model = {"method": "draft_model", "num_speculative_tokens": 3, "model": model_dir}
    eagle3 = {"method": "eagle3", "num_speculative_tokens": 3, "model": adapter_dirs["eagle3"]}
    runs = (("ngram", ngram, []), ("draft_model", draft_model, [f"a8={adapter_dirs['a8']}"]), ("eagle3", eagle3, []))
    for method, spec, draft_adapters in runs:
        outputs, sched = generate(model_dir, mixed_prompts(), spec, adapters=adapters, names=MIXED_NAMES, rank=rank,
                                  tp=2, speculative_lora_modules=draft_adapters)  # fmt: skip
        out[method] = (outputs, {c.lora_id: (c.num_draft_tokens, c.num_accepted_tokens) for c in sched.stats(0).spec})
    return out


def tp_child(rank: int, port: int, model_dir: str, adapter_dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        runner = ModelRunner(config, model_dir, rank, 2, "cpu")
        counts = count_collectives(runner)
        result = {**run_lora(runner, adapter_dirs), **counts}  # the counts so far: the LoRA batches'
        result["speculative"] = speculative_outputs(model_dir, adapter_dirs, rank)  # in this spawn: CI time
        results.put((rank, {**result, "num_layers": len(runner.model.model.layers)}))


def run_tp2(model_dir: str, adapter_dirs: dict[str, str]) -> dict[int, dict]:
    return run_two_ranks(tp_child, model_dir, adapter_dirs, timeout_s=CHILD_TIMEOUT_S)


def test_lora_tp2_matches_tp1(llama_dir: Path, adapter_dirs: dict[str, Path], tmp_path: Path) -> None:
    build_lora_adapter(llama_dir, tmp_path / "b16", r=16, lora_alpha=32, target_modules=TARGET_MODULES, seed=77)
    build_eagle3_head(llama_dir, tmp_path / "eagle3", draft_vocab_size=400, aux_layer_ids=(0, 1, 1), seed=3)
    build_peft_adapter(llama_dir, tmp_path / "copies", r=4, lora_alpha=8, target_modules=("q_proj",), seed=78,
                       modules_to_save=["lm_head"], trainable_token_indices=COPIES_TOKENS)  # fmt: skip
    dirs = {
        name: str(path)
        for name, path in {**adapter_dirs, "b16": tmp_path / "b16", "copies": tmp_path / "copies",
                           "eagle3": tmp_path / "eagle3"}.items()
    }
    by_rank = run_tp2(str(llama_dir), dirs)
    tp1 = run_lora(ModelRunner(tp_config(tp=1), str(llama_dir), 0, 1, "cpu"), dirs)
    for rank in (0, 1):
        for name, ours, ref in zip(MIXED, by_rank[rank]["logits"], tp1["logits"], strict=True):
            diff = abs(ours - ref).max()
            assert diff <= 1e-4, (rank, name, diff)
        for name, ours, ref in zip(MIXED, by_rank[rank]["scaled"], tp1["scaled"], strict=True):
            assert abs(ours - ref).max() <= 1e-4, (rank, name, "scaled")
        for row, (ours, ref) in enumerate(zip(by_rank[rank]["mix"], tp1["mix"], strict=True)):
            assert abs(ours - ref).max() <= 1e-4, (rank, "mix", row)
        assert by_rank[rank]["greedy"] == tp1["greedy"], rank
        # The row-parallel LoRA terms (o_proj, down_proj; every batch here uses an all-module adapter) ride on their
        # layer's own all-reduce: two per decoder layer per forward, as for the base model alone.
        counts = by_rank[rank]
        for row, (ours, ref) in enumerate(zip(by_rank[rank]["copies"], tp1["copies"], strict=True)):
            assert abs(ours - ref).max() <= 1e-4, (rank, "copies", row)
        assert counts["forwards"] == 4 + DECODE_STEPS, counts
        assert counts["all_reduces"] == counts["forwards"] * 2 * counts["num_layers"], counts
    # speculative decoding at TP=2 (n-gram drafts; a draft model with a draft adapter): TP=1's greedy tokens
    reference, _ = generate(str(llama_dir), mixed_prompts(), adapters={n: dirs[n] for n in ("a4", "a8")},
                            names=MIXED_NAMES)  # fmt: skip
    for method in ("ngram", "draft_model", "eagle3"):
        (outputs, counts), (outputs_1, counts_1) = by_rank[0]["speculative"][method], by_rank[1]["speculative"][method]
        assert outputs == outputs_1 == reference, method
        assert counts == counts_1 and all(drafted > 0 for drafted, _ in counts.values()), (method, counts)
    a8 = by_rank[0]["speculative"]["draft_model"][1][ADAPTER_IDS["a8"]]
    assert a8[0] == a8[1]  # a8's draft adapter is a8 on the target itself: every draft accepted
    assert abs(tp1["scaled"][1] - tp1["logits"][1]).max() > 1e-3  # the strengths change the adapter rows
    assert abs(tp1["mix"][0] - tp1["logits"][0]).max() > 1e-3  # the mix changes its row (MIXED[0] is the base)
    assert abs(tp1["copies"][0] - tp1["copies"][1]).max() > 1e-1  # the copy and the token rows change their row


def test_adapter_is_sliced_per_rank(llama_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    # Column-parallel (q, k, v, gate, up): A whole, B's rows split. Row-parallel (o, down): A's columns split, B whole.
    full = load_file(adapter_dirs["a64"] / "adapter_model.safetensors")
    spec = PoolSpec(max_lora_rank=64, target_modules=TARGET_MODULES, dtype=torch.float32, device=torch.device("cpu"))
    config = ModelConfig.from_dir(str(llama_dir))
    for tp_rank in (0, 1):
        adapter = load_adapter(str(adapter_dirs["a64"]), 5, config, spec, tp_rank, 2)
        assert len(adapter.weights) == config.num_layers * len(TARGET_MODULES)
        for (layer, module), (lora_a, lora_b) in adapter.weights.items():
            name = f"base_model.model.model.layers.{layer}.{'self_attn' if module in ATTN_MODULES else 'mlp'}.{module}"
            full_a, full_b = full[f"{name}.lora_A.weight"], full[f"{name}.lora_B.weight"]
            if module in ("o_proj", "down_proj"):
                full_a = full_a.chunk(2, dim=1)[tp_rank]
            else:
                full_b = full_b.chunk(2, dim=0)[tp_rank]
            assert torch.equal(lora_a, full_a) and torch.equal(lora_b, full_b), module
