"""A Phi-4-mini-shaped tiny model (fused checkpoint, partial rotary, longrope) served end to end with PEFT adapters
on its fused modules: one batch mixing base and two adapters, prompts prefilled in chunks, a repeat served from the
prefix cache, each equal to HF + peft; with an original length of 12, most sequences pass it (and are recomputed with
the long factors, as transformers encodes them) and one prompt is longer from the start."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.builders import build_tokenizer, tokenizer_vocab_size
from tests.lora_helpers import build_peft_adapter
from tests.phi3_helpers import PHI3_TARGETS, PHI4_MINI_LIKE, build_tiny_phi3
from tests.reference import assert_greedy_match, hf_greedy
from tests.server_utils import ServerProcess

EOS = (2,)
MAX_NEW = 12
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
PROMPTS = [
    "Hello there",
    "The quick brown fox jumps",
    "Once upon a time in the town there lived an old farmer who kept cows on his land",
    "She said that",
]
ORIGINAL_LEN = 12
NAMES = [None, "fused", "attn", "fused"]


@pytest.fixture(scope="module")
def phi3_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("phi3_server")
    build_tiny_phi3(root / "base", vocab_size=tokenizer_vocab_size(),
                    **{**PHI4_MINI_LIKE, "original_max_position_embeddings": ORIGINAL_LEN})  # fmt: skip
    build_tokenizer(root / "base")
    build_peft_adapter(root / "base", root / "fused", r=8, lora_alpha=16, target_modules=PHI3_TARGETS, seed=1)
    build_peft_adapter(root / "base", root / "attn", r=4, lora_alpha=8, target_modules=("qkv_proj",), seed=2)
    return {name: root / name for name in ("base", "fused", "attn")}


def test_phi3_mixed_batch_with_chunks_and_prefix_cache_equals_peft(phi3_dirs: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(phi3_dirs["base"])
    lora_paths = [f"{name}={phi3_dirs[name]}" for name in ("fused", "attn")]
    with ServerProcess("--model-path", str(phi3_dirs["base"]), "--lora-paths", *lora_paths, "--max-loras-per-batch",
                       "2", "--max-lora-rank", "8", "--chunked-prefill-size", "4", "--page-size", "4",
                       "--context-length", "128") as server:  # fmt: skip
        first = server.post("/generate", {"text": PROMPTS, "lora_path": NAMES, "sampling_params": GREEDY})
        assert first.status_code == 200, first.text
        again = server.post("/generate", {"text": PROMPTS, "lora_path": NAMES, "sampling_params": GREEDY})
        assert again.status_code == 200, again.text
        table = {a["lora_name"]: a for a in server.get("/lora_adapters").json()["adapters"]}
        info = server.get("/server_info").json()
    assert table["attn"]["target_modules"] == ["q_proj", "k_proj", "v_proj"]
    assert [o["output_ids"] for o in again.json()] == [o["output_ids"] for o in first.json()]
    assert info["prefix_cache_hit_tokens"] > 0, "the repeat missed the prefix cache"
    lengths = [len(tokenizer(p)["input_ids"]) for p in PROMPTS]
    assert max(lengths) > ORIGINAL_LEN and min(lengths) + MAX_NEW > ORIGINAL_LEN + 1
    assert info["num_preemptions"] >= 2 * sum(n <= ORIGINAL_LEN for n in lengths)  # the recomputes, both rounds
    for prompt, name, out in zip(PROMPTS, NAMES, first.json(), strict=True):
        adapter = None if name is None else phi3_dirs[name]
        ref, margins = hf_greedy(phi3_dirs["base"], tokenizer(prompt)["input_ids"], MAX_NEW, adapter, eos_token_ids=EOS)
        assert_greedy_match(out["output_ids"], ref, margins, f"{name}: {prompt}")
