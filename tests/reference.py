"""HF transformers (+ peft) as the numerical oracle: greedy tokens with the top-1 margin of each step."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

CLEAR_MARGIN = 1e-3  # below this, a tiny float difference may pick the other token: stop comparing there


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str, adapter_dir: str | None = None):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


@torch.inference_mode()
def hf_logits(model_dir: str | Path, prompt_ids: list[int], adapter_dir: str | Path | None = None) -> torch.Tensor:
    model = hf_model(str(model_dir), None if adapter_dir is None else str(adapter_dir))
    return model(torch.tensor([prompt_ids])).logits[0]  # (len, vocab)


@torch.inference_mode()
def hf_greedy(model_dir: str | Path, prompt_ids: list[int], max_new_tokens: int, adapter_dir: str | Path | None = None,
              eos_token_ids: tuple[int, ...] = ()) -> tuple[list[int], list[float]]:
    """Greedy continuation computed step by step with the full sequence each step, and each step's top-1 margin."""
    model = hf_model(str(model_dir), None if adapter_dir is None else str(adapter_dir))
    ids = list(prompt_ids)
    out: list[int] = []
    margins: list[float] = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        top2 = torch.topk(logits, 2)
        token = int(top2.indices[0])
        margins.append(float(top2.values[0] - top2.values[1]))
        out.append(token)
        ids.append(token)
        if token in eos_token_ids:
            break
    return out, margins


def assert_greedy_match(ours: list[int], ref: list[int], margins: list[float], what: str = "") -> int:
    """Tokens must agree up to the first step where the reference's choice was a near tie; returns steps compared."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if margins[i] < CLEAR_MARGIN:
            return i
        assert a == b, f"{what}: token {i} differs: ours {ours[: i + 1]} vs reference {ref[: i + 1]}"
    assert len(ours) == len(ref), f"{what}: lengths differ: ours {ours} vs reference {ref}"
    return len(ref)
