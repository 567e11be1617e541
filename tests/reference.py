"""HF transformers (+ peft) as the numerical oracle: greedy tokens with the top-1 margin of each step."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

if TYPE_CHECKING:
    from tests.server_utils import ServerProcess

# prompts for a server batch, sharing a prefix of more than 8 tokens
SHARED_PREFIX = "The morning was cold and clear, and the old farmer walked slowly down the lane. "
SHARED_PREFIX_PROMPTS = [SHARED_PREFIX + tail for tail in ("He", "The cows", "Then", "A thin layer of frost")]
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
    return greedy_with_margins(model, prompt_ids, max_new_tokens, eos_token_ids)


@torch.inference_mode()
def greedy_with_margins(model, prompt_ids: list[int], max_new_tokens: int,
                        eos_token_ids: tuple[int, ...] = ()) -> tuple[list[int], list[float]]:
    """hf_greedy on a model already built (a merged reference)."""
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


def assert_mixed_batch_equals_peft(server: ServerProcess, model_dir: Path, adapter_dirs: dict[str, Path],
                                   names: list[str | None], sampling_params: dict,
                                   eos_token_ids: tuple[int, ...] = ()) -> None:
    """One /generate batch of SHARED_PREFIX_PROMPTS (to a server with server_utils.CHUNKED_ARGS), each under its
    adapter name (None: the base model), equals HF + peft's greedy tokens; cold, and again when the prompts' prefixes
    come from the cache."""
    max_new_tokens = sampling_params["max_new_tokens"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    refs = [hf_greedy(model_dir, tokenizer(prompt)["input_ids"], max_new_tokens,
                      None if name is None else adapter_dirs[name], eos_token_ids=eos_token_ids)
            for prompt, name in zip(SHARED_PREFIX_PROMPTS, names, strict=True)]  # fmt: skip
    assert len(tokenizer(SHARED_PREFIX)["input_ids"]) > 8  # each prompt takes more than one chunk of 8
    for attempt in ("cold", "cached"):
        body = {"text": SHARED_PREFIX_PROMPTS, "lora_path": names, "sampling_params": sampling_params}
        resp = server.post("/generate", body)
        assert resp.status_code == 200, resp.text
        num_compared = sum(assert_greedy_match(out["output_ids"], ref, margins, f"{attempt} {name or 'base'}")
                           for out, (ref, margins), name in zip(resp.json(), refs, names, strict=True))  # fmt: skip
        assert num_compared >= max_new_tokens * len(SHARED_PREFIX_PROMPTS) // 2  # most steps had a clear margin
    # The second round (and the batch's later rows with one adapter) found their prefix in the cache.
    assert server.get("/server_info").json()["prefix_cache_hit_tokens"] > 0


def peft_mix(model_dir: str | Path, adapter_dirs: dict[str, Path], weights: list[float], combination_type: str,
             density: float | None = None, seed: int = 0):
    """HF + peft (fp32) with add_weighted_adapter's combination of the adapters active, as adapter "mix": loraplex's
    linear mix is PEFT's "cat". Torch's global generator is seeded with `seed` as the combination begins (after
    add_weighted_adapter has drawn the new adapter's initial weights): dare_linear's masks come from there."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = list(adapter_dirs)
    model = PeftModel.from_pretrained(base, str(adapter_dirs[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapter_dirs[name]), adapter_name=name)
    combine = model.base_model._generalized_task_arithmetic_weighted_adapter
    calls = []

    def seeded_first(*args, **kwargs):
        if not calls:
            torch.manual_seed(seed)
        calls.append(1)
        return combine(*args, **kwargs)

    model.base_model._generalized_task_arithmetic_weighted_adapter = seeded_first
    model.add_weighted_adapter(names, weights, "mix", combination_type=combination_type, density=density)
    model.set_adapter("mix")
    return model.eval()
