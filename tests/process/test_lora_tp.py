"""Multi-LoRA under tensor parallelism: two gloo ranks serving one batch of five adapters must reproduce tp=1; so
must a mix, per-request strengths, and adapters with module copies (lm_head, embed_tokens, both), trainable tokens
and an added token's rows, in one batch with the base model and a plain adapter; and speculative decoding (n-gram
drafts, a draft model with a draft adapter, an EAGLE-3 head) over the base and two adapters."""

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
    SLOTS,
    batch_logits,
    build_peft_adapter,
    greedy_decode,
    load_all,
)
from tests.speculative_helpers import MIXED_NAMES, generate, mixed_prompts, processed_sampling
from tests.worker_helpers import GREEDY, consecutive_pages, forward_logits, random_prompts, run_two_ranks, tp_group

DECODE_STEPS = 6
SCALES = [1.0, 0.5, 0.0, 4.0, 1.0, 0.25, 1.0, 2.0, 1.5]  # per MIXED row (its base rows stay at 1)
MIX_ID, MIX_SLOT = 9, 5  # a slot lora_helpers' adapters leave free
COPIES_TOKENS = [3, 5, 7]  # the "copies" adapter's trainable tokens
# Adapters with full module copies (modules_to_save) and token rows: name -> (lora_id, slot), the slots past
# lora_helpers' five. "added": an adapter's own added tokens, which the frontend gives the embedding's rows past the
# base tokenizer's (tests/server/test_adapter_tokenizers.py): here the two last rows, trained as token rows beside an
# lm_head copy; the workers see only their ids.
COPY_ADAPTERS = {"copies": (10, 5), "embed": (11, 6), "both": (12, 7), "added": (13, 8)}
COPY_ROWS = [None, "a4", *COPY_ADAPTERS]  # the copies batch: one prompt on each
CHILD_TIMEOUT_S = 300


def tp_config(tp: int) -> ServerConfig:
    lora = {**LORA_CONFIG, "max_loras_per_batch": 9}  # lora_helpers' five slots, the mix's, and the copies'
    return ServerConfig(device="cpu", tp=tp, page_size=4, max_total_tokens=512, max_full_module_copies=4, **lora)


def added_ids(vocab_size: int) -> list[int]:
    return [vocab_size - 2, vocab_size - 1]


def build_copy_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    """COPY_ADAPTERS, saved by peft: each a small LoRA beside its copies and token rows."""
    added = added_ids(ModelConfig.from_dir(str(model_dir)).vocab_size)
    extra = {
        "copies": {"modules_to_save": ["lm_head"], "trainable_token_indices": COPIES_TOKENS},
        "embed": {"modules_to_save": ["embed_tokens"]},
        "both": {"modules_to_save": ["lm_head", "embed_tokens"]},
        "added": {"modules_to_save": ["lm_head"], "trainable_token_indices": added},
    }
    for seed, (name, config) in enumerate(extra.items(), start=78):
        build_peft_adapter(model_dir, root / name, r=4, lora_alpha=8, target_modules=("q_proj",), seed=seed, **config)
    return {name: root / name for name in extra}


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


def copies_logits(runner: ModelRunner, adapter_dirs: dict[str, str], prompt: list[int]) -> list:
    """COPY_ADAPTERS in one batch with the base model and a4, one row each, all on one prompt that holds the copies
    adapter's tokens and the added ones: the embedding and the LM head are whole on every rank, and so are the
    copies and rows (worker/lora/copies.py)."""
    specs = [AdapterToLoad(lora_name=name, lora_path=adapter_dirs[name], lora_id=lora_id)
             for name, (lora_id, _) in COPY_ADAPTERS.items()]  # fmt: skip
    outcomes = runner.lora.load(specs)
    assert all(o.success for o in outcomes), [o.error_message for o in outcomes]
    prompt = prompt[:1] + COPIES_TOKENS + added_ids(runner.vocab_size) + prompt[6:]
    slots = [-1, SLOTS["a4"], *(slot for _, slot in COPY_ADAPTERS.values())]
    pages = consecutive_pages([len(prompt)] * len(slots), runner.page_size)
    reqs = [ForwardReq(input_ids=prompt, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=slot)
            for pg, slot in zip(pages, slots, strict=True)]  # fmt: skip
    loads = [SlotLoad(slot=SLOTS["a4"], lora_id=ADAPTER_IDS["a4"])]
    loads += [SlotLoad(slot=slot, lora_id=lora_id) for lora_id, slot in COPY_ADAPTERS.values()]
    batch = ForwardBatch(batch_id=51, reqs=reqs, slot_loads=loads)
    return [t.numpy() for t in forward_logits(runner, batch).split([len(prompt)] * len(slots))]


def held_copies(runner: ModelRunner) -> dict[str, dict[str, object]]:
    """What this rank holds of COPY_ADAPTERS' copies and token rows after their slot loads (numpy)."""
    held = {}
    for name, (lora_id, _) in COPY_ADAPTERS.items():
        held[name] = {module: t.numpy() for module, t in runner.lora.copies.device_copies.get(lora_id, {}).items()}
        if lora_id in runner.lora.copies.device_rows:
            held[name]["tokens"] = [t.numpy() for t in runner.lora.copies.device_rows[lora_id]]
    return held


def run_lora(runner: ModelRunner, adapter_dirs: dict[str, str]) -> dict:
    """The mixed batches; a mix and the copies batch where adapter_dirs holds "b16" and COPY_ADAPTERS."""
    load_all(runner, adapter_dirs)
    prompts = random_prompts(MIXED_LENGTHS, runner.vocab_size, seed=21)
    extra = {}
    if "b16" in adapter_dirs:
        extra["mix"] = mix_logits(runner, adapter_dirs, prompts[:3])
    if "copies" in adapter_dirs:
        extra["copies"] = copies_logits(runner, adapter_dirs, prompts[3])
        extra["held_copies"] = held_copies(runner)
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
    # penalties and grammars verified row by row: rank 0 masks, and its verdict is broadcast
    outputs, sched = generate(model_dir, mixed_prompts(), draft_model, adapters=adapters, names=MIXED_NAMES, rank=rank,
                              tp=2, sampling=processed_sampling(model_dir, len(MIXED_NAMES)))  # fmt: skip
    out["processed"] = (outputs, {c.lora_id: (c.num_draft_tokens, c.num_accepted_tokens) for c in sched.stats(0).spec})
    return out


def tp_child(rank: int, port: int, model_dir: str, adapter_dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        runner = ModelRunner(config, model_dir, rank, 2, "cpu")
        counts = count_collectives(runner)
        result = {**run_lora(runner, adapter_dirs), **counts}  # the counts so far: the LoRA batches'
        if "eagle3" in adapter_dirs:  # speculative decoding in this spawn (CI time); test_quantized_tp gives no head
            result["speculative"] = speculative_outputs(model_dir, adapter_dirs, rank)
        results.put((rank, {**result, "num_layers": len(runner.model.model.layers)}))


def assert_same(ours, ref, where) -> None:
    """Equal arrays, or equal lists of arrays (a token patch: its ids and rows)."""
    pairs = zip(ours, ref, strict=True) if isinstance(ours, list) else [(ours, ref)]
    assert all(a.shape == b.shape and (a == b).all() for a, b in pairs), where


def run_tp2(model_dir: str, adapter_dirs: dict[str, str]) -> dict[int, dict]:
    return run_two_ranks(tp_child, model_dir, adapter_dirs, timeout_s=CHILD_TIMEOUT_S)


def test_lora_tp2_matches_tp1(llama_dir: Path, adapter_dirs: dict[str, Path], tmp_path: Path) -> None:
    build_lora_adapter(llama_dir, tmp_path / "b16", r=16, lora_alpha=32, target_modules=TARGET_MODULES, seed=77)
    build_eagle3_head(llama_dir, tmp_path / "eagle3", draft_vocab_size=400, aux_layer_ids=(0, 1, 1), seed=3)
    copies = build_copy_adapters(llama_dir, tmp_path)
    dirs = {name: str(path) for name, path in {**adapter_dirs, "b16": tmp_path / "b16", **copies,
                                               "eagle3": tmp_path / "eagle3"}.items()}  # fmt: skip
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
        for name, ours, ref in zip(COPY_ROWS, by_rank[rank]["copies"], tp1["copies"], strict=True):
            assert abs(ours - ref).max() <= 1e-4, (rank, "copies batch", name)
        # the embedding and the LM head are replicated, not vocab-parallel: every rank holds the whole of each copy
        # and token patch, as at tp=1
        for name, held in by_rank[rank]["held_copies"].items():
            assert held.keys() == tp1["held_copies"][name].keys(), (rank, name)
            for module, ours in held.items():
                assert_same(ours, tp1["held_copies"][name][module], (rank, name, module))
        assert counts["forwards"] == 4 + DECODE_STEPS, counts
        assert counts["all_reduces"] == counts["forwards"] * 2 * counts["num_layers"], counts
    # speculative decoding at TP=2 (n-gram drafts; a draft model with a draft adapter): TP=1's greedy tokens
    reference, _ = generate(str(llama_dir), mixed_prompts(), adapters={n: dirs[n] for n in ("a4", "a8")},
                            names=MIXED_NAMES)  # fmt: skip
    for method in ("ngram", "draft_model", "eagle3"):
        (outputs, counts), (outputs_1, counts_1) = by_rank[0]["speculative"][method], by_rank[1]["speculative"][method]
        assert outputs == outputs_1 == reference, method
        assert counts == counts_1 and all(drafted > 0 for drafted, _ in counts.values()), (method, counts)
    processed = processed_sampling(llama_dir, len(MIXED_NAMES))
    reference, _ = generate(str(llama_dir), mixed_prompts(), adapters={n: dirs[n] for n in ("a4", "a8")},
                            names=MIXED_NAMES, sampling=processed)  # fmt: skip
    (outputs, counts), (outputs_1, counts_1) = (by_rank[r]["speculative"]["processed"] for r in (0, 1))
    assert outputs == outputs_1 == reference and counts == counts_1, counts
    assert all(drafted > 0 for drafted, _ in counts.values()), counts
    a8 = by_rank[0]["speculative"]["draft_model"][1][ADAPTER_IDS["a8"]]
    assert a8[0] == a8[1]  # a8's draft adapter is a8 on the target itself: every draft accepted
    assert abs(tp1["scaled"][1] - tp1["logits"][1]).max() > 1e-3  # the strengths change the adapter rows
    assert abs(tp1["mix"][0] - tp1["logits"][0]).max() > 1e-3  # the mix changes its row (MIXED[0] is the base)
    # ... and what tp=1 holds is what peft saved: the whole (vocab, hidden) copies, the token ids and their rows
    vocab_size = ModelConfig.from_dir(str(llama_dir)).vocab_size
    expected = {"copies": {"lm_head", "tokens"}, "embed": {"embed_tokens"}, "both": {"lm_head", "embed_tokens"},
                "added": {"lm_head", "tokens"}}  # fmt: skip
    for name, path in copies.items():
        held, saved = tp1["held_copies"][name], load_file(path / "adapter_model.safetensors")
        assert held.keys() == expected[name], name
        for key, tensor in saved.items():
            module = next((m for m in ("lm_head", "embed_tokens") if key.endswith(f"{m}.weight")), None)
            if module is not None:
                assert tensor.shape[0] == vocab_size and (held[module] == tensor.numpy()).all(), (name, key)
            elif "trainable_tokens_delta" in key:
                ids = COPIES_TOKENS if name == "copies" else added_ids(vocab_size)
                assert held["tokens"][0].tolist() == ids and (held["tokens"][1] == tensor.numpy()).all(), (name, key)
    # each copy and each patch of token rows changes its row, against the base model's on the same prompt
    base, _, with_tokens, embed, both, added = tp1["copies"]
    for name, logits in zip(COPY_ADAPTERS, (with_tokens, embed, both, added), strict=True):
        assert abs(logits - base).max() > 1e-1, name
    # the embed_tokens copies at the first position alone (the LoRA on q_proj leaves it as it is: its attention reads
    # only its own value)
    assert abs(embed[0] - base[0]).max() > 1e-1 and abs(both[0] - base[0]).max() > 1e-1


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
