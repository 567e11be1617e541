"""Phi-3 under tensor parallelism: fused checkpoint tensors and fused-module adapters cut per slice, so two gloo
ranks serving a mixed batch (an adapter on the embedding and LM head in it) reproduce tp=1; a node-0 cut
(--nnodes > 1) of a fused adapter equals a rank's own."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from loraplex.frontend.adapters.files import cut_per_rank, read_adapter_dir
from loraplex.protocol.adapters.lora_targets import TARGET_MODULES
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, SlotLoad
from loraplex.worker.lora.adapter import PoolSpec, adapter_from_tensors, load_adapter
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model_runner import ModelRunner
from safetensors.torch import load_file

from tests.lora_helpers import build_peft_adapter
from tests.phi3_helpers import PHI3_TARGETS, PHI4_MINI_LIKE, build_tiny_phi3
from tests.worker_helpers import GREEDY, decode, forward_logits, random_prompts, run_two_ranks, tp_group

NAMES = [None, "fused", "attn", "vocab", "fused"]
IDS = {"fused": 1, "attn": 2, "vocab": 3}
SLOTS = {"fused": 0, "attn": 1, "vocab": 2}
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def phi3_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("phi3_tp")
    build_tiny_phi3(root / "base", **PHI4_MINI_LIKE)
    build_peft_adapter(root / "base", root / "fused", r=8, lora_alpha=16, target_modules=PHI3_TARGETS, seed=1)
    build_peft_adapter(root / "base", root / "attn", r=4, lora_alpha=8, target_modules=("qkv_proj",), seed=2)
    # the embedding and the (tied) LM head are replicated: every rank adds their whole LoRA term
    build_peft_adapter(root / "base", root / "vocab", r=4, lora_alpha=8,
                       target_modules=("embed_tokens", "lm_head", "down_proj"), seed=3)  # fmt: skip
    return {name: str(root / name) for name in ("base", "fused", "attn", "vocab")}


def tp_config(tp: int) -> ServerConfig:
    return ServerConfig(device="cpu", tp=tp, page_size=4, max_total_tokens=512, enable_lora=True, max_lora_rank=8,
                        lora_target_modules=["all", "embed_tokens", "lm_head"], max_loras_per_batch=3)  # fmt: skip


def run_phi3(runner: ModelRunner, dirs: dict[str, str]) -> dict:
    results = runner.lora.load([AdapterToLoad(lora_name=n, lora_path=dirs[n], lora_id=i) for n, i in IDS.items()])
    assert all(r.success for r in results), [r.error_message for r in results]
    slot_loads = [SlotLoad(slot=SLOTS[n], lora_id=IDS[n]) for n in IDS]
    slots = [-1 if n is None else SLOTS[n] for n in NAMES]
    prompts = random_prompts([5, 8, 11, 6, 3], runner.vocab_size, seed=3)
    page_ids, first = [], 0
    for prompt in prompts:
        page_ids.append(list(range(first, first + -(-len(prompt) // 4))))
        first += len(page_ids[-1])
    reqs = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=s)
            for p, pg, s in zip(prompts, page_ids, slots, strict=True)]  # fmt: skip
    logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=slot_loads))
    greedy = decode(runner, prompts, [GREEDY] * len(prompts), DECODE_STEPS, slots=slots, slot_loads=slot_loads)
    return {"logits": logits.numpy(), "greedy": greedy}


def tp_child(rank: int, port: int, dirs: dict[str, str], results: mp.Queue) -> None:
    config = tp_config(tp=2)
    with tp_group(config, rank, port):
        results.put((rank, run_phi3(ModelRunner(config, dirs["base"], rank, 2, "cpu"), dirs)))


def test_phi3_tp2_matches_tp1(phi3_dirs: dict[str, str]) -> None:
    by_rank = run_two_ranks(tp_child, phi3_dirs, timeout_s=120)
    tp1 = run_phi3(ModelRunner(tp_config(tp=1), phi3_dirs["base"], 0, 1, "cpu"), phi3_dirs)
    for rank in (0, 1):
        assert abs(by_rank[rank]["logits"] - tp1["logits"]).max() <= 1e-4, rank
        assert by_rank[rank]["greedy"] == tp1["greedy"], rank


def test_fused_adapter_is_cut_per_slice_and_rank(phi3_dirs: dict[str, str]) -> None:
    config = ModelConfig.from_dir(phi3_dirs["base"])
    full = load_file(Path(phi3_dirs["fused"]) / "adapter_model.safetensors")
    spec = PoolSpec(max_lora_rank=8, target_modules=TARGET_MODULES, dtype=torch.float32, device=torch.device("cpu"))
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    slices = {"q_proj": (0, q_size), "k_proj": (q_size, kv_size), "v_proj": (q_size + kv_size, kv_size),
              "gate_proj": (0, inter), "up_proj": (inter, inter)}  # fmt: skip
    raw_config, specs, buffers = read_adapter_dir(phi3_dirs["fused"], None)
    per_rank = cut_per_rank(specs, buffers, tp_size=2)
    for tp_rank in (0, 1):
        adapter = load_adapter(phi3_dirs["fused"], 1, config, spec, tp_rank, 2)
        sent = adapter_from_tensors(raw_config, specs, per_rank[tp_rank], 1, config, spec, tp_rank, 2, is_cut=True)
        assert adapter.target_modules == sent.target_modules == TARGET_MODULES
        assert len(adapter.weights) == config.num_layers * len(TARGET_MODULES)
        for (layer, module), (lora_a, lora_b) in adapter.weights.items():
            fused = {"q_proj": "self_attn.qkv_proj", "k_proj": "self_attn.qkv_proj", "v_proj": "self_attn.qkv_proj",
                     "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_up_proj", "up_proj": "mlp.gate_up_proj",
                     "down_proj": "mlp.down_proj"}[module]  # fmt: skip
            name = f"base_model.model.model.layers.{layer}.{fused}"
            full_a, full_b = full[f"{name}.lora_A.weight"], full[f"{name}.lora_B.weight"]
            if module in slices:  # column-parallel: this slice's rows of B, then this rank's half of them
                start, length = slices[module]
                full_b = full_b.narrow(0, start, length).chunk(2, dim=0)[tp_rank]
            else:  # row-parallel: A's columns split, B whole
                full_a = full_a.chunk(2, dim=1)[tp_rank]
            assert torch.equal(lora_a, full_a) and torch.equal(lora_b, full_b), module
            sent_a, sent_b = sent.weights[(layer, module)]
            assert torch.equal(sent_a, lora_a) and torch.equal(sent_b, lora_b), module
