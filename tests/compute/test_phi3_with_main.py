"""Phi-3 with what other families brought: a sliding window on every layer (as Phi-3-mini's config sets one), PEFT's
rank_pattern / alpha_pattern on the fused modules and the LM head (matched against the fused module's name, as PEFT
matches them), and --load-format dummy on its fused layers, against HF transformers + peft."""

from __future__ import annotations

from pathlib import Path

import torch
from loraplex.protocol.structs import AdapterToLoad, SlotLoad
from loraplex.worker.dummy_weights import init_dummy_weights
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.registry import build_model
from loraplex.worker.parallel import tensor_parallel

from tests.phi3_helpers import PHI4_MINI_LIKE, TINY_PHI3, build_tiny_phi3
from tests.reference import hf_model
from tests.worker_helpers import make_runner, prefill_logits, random_prompts

WINDOW = 6


def build_pattern_adapter(base_dir: Path, out_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj", "lm_head"],
                        init_lora_weights=False, rank_pattern={"qkv_proj": 8},
                        alpha_pattern={"lm_head": 2, r"layers\.1\.mlp\.gate_up_proj": 32})  # fmt: skip
    get_peft_model(model, config).save_pretrained(out_dir, save_embedding_layers=False)


@torch.inference_mode()
def test_sliding_window_and_patterns_on_fused_modules_match_peft(tmp_path: Path) -> None:
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "patterns"
    build_tiny_phi3(base_dir, sliding_window=WINDOW)
    build_pattern_adapter(base_dir, adapter_dir)
    runner = make_runner(base_dir, enable_lora=True, max_lora_rank=8, lora_target_modules=["all", "lm_head"],
                         max_loras_per_batch=2)  # fmt: skip
    assert runner.model_config.attention_window == WINDOW
    results = runner.lora.load([AdapterToLoad(lora_name="p", lora_path=str(adapter_dir), lora_id=1)])
    assert results[0].success and results[0].lora_rank == 8, results[0].error_message
    adapter = runner.lora.adapters[1]
    assert adapter.weights[(0, "k_proj")][0].shape[0] == 8 and adapter.weights[(0, "up_proj")][0].shape[0] == 4
    runner.lora.apply_slot_loads([SlotLoad(slot=0, lora_id=1)])
    prompt = random_prompts([15], runner.vocab_size, seed=4)[0]  # longer than the window
    base = hf_model(str(base_dir))(torch.tensor([prompt])).logits[0]
    assert (prefill_logits(runner, prompt) - base).abs().max().item() <= 1e-4
    ref = hf_model(str(base_dir), str(adapter_dir))(torch.tensor([prompt])).logits[0]
    assert (prefill_logits(runner, prompt, slot=0) - ref).abs().max().item() <= 1e-4
    assert (ref - base).abs().max().item() > 0.1  # the adapter is visible
    unwindowed = hf_model(str(base_dir))
    unwindowed.config.sliding_window = None
    assert (unwindowed(torch.tensor([prompt])).logits[0] - base).abs().max().item() > 0.1  # the window is visible


def test_dummy_weights_on_fused_layers_are_the_same_at_every_tp_degree(tmp_path: Path) -> None:
    from transformers import Phi3Config

    Phi3Config(**{**TINY_PHI3, **PHI4_MINI_LIKE}).save_pretrained(tmp_path)  # config.json, no weights

    def dummy(rank: int, world_size: int) -> torch.nn.Module:
        with tensor_parallel(rank, world_size):
            model = build_model(ModelConfig.from_dir(str(tmp_path)), max_positions=64)
        init_dummy_weights(model, 0.02, seed=0)
        return model

    full = dummy(0, 1).model.layers[0]
    q_size, kv_size, _ = full.self_attn.qkv_proj.output_sizes
    q, k, v = full.self_attn.qkv_proj.weight.split([q_size, kv_size, kv_size])
    gate, up = full.mlp.gate_up_proj.weight.chunk(2)
    assert not torch.equal(k, v) and not torch.equal(gate, up)  # each slice has its own draw
    for rank in (0, 1):
        shard = dummy(rank, 2).model.layers[0]
        expected = torch.cat([t.chunk(2)[rank] for t in (q, k, v)])
        assert torch.equal(shard.self_attn.qkv_proj.weight, expected)
        assert torch.equal(shard.mlp.gate_up_proj.weight, torch.cat([t.chunk(2)[rank] for t in (gate, up)]))
    runner = make_runner(tmp_path, load_format="dummy")
    assert torch.isfinite(prefill_logits(runner, random_prompts([9], runner.vocab_size, seed=3)[0])).all()
