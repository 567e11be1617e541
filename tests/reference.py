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


def assert_logits_match_peft(ours: list[torch.Tensor], prompts: list[list[int]], names: list[str | None],
                             model_dir: str | Path, adapter_dirs: dict[str, Path], tol: float,
                             min_effect: float) -> dict[str, float]:
    """Each request's (len, vocab) logits equal HF + peft's (name None: the base model) within `tol`, and each
    adapter moves HF's logits by more than `min_effect`, so the comparison tells it from none. Returns the largest
    difference per name ("base" for None)."""
    max_diffs: dict[str, float] = {}
    for prompt, name, logits in zip(prompts, names, ours, strict=True):
        ref = hf_logits(model_dir, prompt, None if name is None else adapter_dirs[name])
        diff = (logits - ref).abs().max().item()
        max_diffs[name or "base"] = max(diff, max_diffs.get(name or "base", 0.0))
        assert diff <= tol, f"{name or 'base'}: max abs logit diff {diff:.2e}"
        if name is not None:
            effect = (ref - hf_logits(model_dir, prompt, None)).abs().max().item()
            assert effect > min_effect, f"{name} barely changes the logits ({effect:.3f})"
    return max_diffs


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


def assert_greedy_matches_peft(outputs: list[list[int]], prompts: list[list[int]], names: list[str | None],
                               model_dir: str | Path, adapter_dirs: dict[str, Path], steps: int) -> None:
    """Each request's `steps` greedy tokens equal HF + peft's (name None: the base model) up to a near tie, and most
    steps had a clear margin."""
    num_compared = 0
    for prompt, name, out in zip(prompts, names, outputs, strict=True):
        ref, margins = hf_greedy(model_dir, prompt, steps, None if name is None else adapter_dirs[name])
        num_compared += assert_greedy_match(out, ref, margins, what=name or "base")
    assert num_compared >= steps * len(prompts) // 2, f"only {num_compared} tokens had a clear margin"
