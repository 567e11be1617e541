"""PEFT's rank_pattern and alpha_pattern on a dense model: modules with their own rank and alpha, beside modules at
the adapter's r and lora_alpha, equal peft (the pool pads each to the largest rank and folds each module's scale
into its B)."""

from __future__ import annotations

from pathlib import Path

import torch
from loraplex.protocol.structs import AdapterToLoad, SlotLoad

from tests.reference import hf_model
from tests.worker_helpers import make_runner, prefill_logits, random_prompts


def build_pattern_adapter(base_dir: Path, out_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                        rank_pattern={"q_proj": 8}, alpha_pattern={"down_proj": 32, r"layers\.1\.self_attn\.v_proj": 2})
    get_peft_model(model, config).save_pretrained(out_dir)


def test_rank_and_alpha_patterns_match_peft(llama_dir: Path, tmp_path: Path) -> None:
    adapter_dir = tmp_path / "patterns"
    build_pattern_adapter(llama_dir, adapter_dir)
    runner = make_runner(llama_dir, enable_lora=True, max_lora_rank=8, lora_target_modules=["all"],
                         max_loras_per_batch=2)  # fmt: skip
    results = runner.lora.load([AdapterToLoad(lora_name="p", lora_path=str(adapter_dir), lora_id=1)])
    assert results[0].success and results[0].lora_rank == 8, results[0].error_message
    adapter = runner.lora.adapters[1]
    assert adapter.weights[(0, "q_proj")][0].shape[0] == 8 and adapter.weights[(0, "v_proj")][0].shape[0] == 4
    prompt = random_prompts([10], runner.vocab_size, seed=4)[0]
    runner.lora.apply_slot_loads([SlotLoad(slot=0, lora_id=1)])
    ours = prefill_logits(runner, prompt, slot=0)
    with torch.inference_mode():
        ref = hf_model(str(llama_dir), str(adapter_dir))(torch.tensor([prompt])).logits[0]
        base = hf_model(str(llama_dir))(torch.tensor([prompt])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-4
    assert (ref - base).abs().max().item() > 0.1  # the adapter is visible
