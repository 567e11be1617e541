"""Draft adapters' acceptance on the trained demo model: the draft model is the demo cut to its first N layers, and each
demo adapter's draft adapter is that adapter's first N layers (--speculative-lora-modules), against the bare cut
draft for every adapter. Greedy requests (the demo's task prompts, base and the three adapters in one batch) through
the real scheduler and a worker in one process (tests/speculative_helpers.py); outputs are checked equal to those
without speculation, and the acceptance per adapter (accepted / drafted) is printed with and without draft adapters.

    python -m scripts.bench.spec_acceptance [--layers N] [--k K]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
import time
from pathlib import Path

from loraplex.frontend.demo import DEMO_DIR, demo_adapter_paths
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from tests.speculative_helpers import generate

WORDS = ["fresh bread", "lora plex", "plug and play", "quick brown fox", "green apple", "many small", "one batch",
         "serve fast"]  # fmt: skip
LORA_CONFIG = dict(enable_lora=True, max_lora_rank=64, lora_target_modules=["all"], max_loras_per_batch=4)


def _first_layers(tensors: dict, num_layers: int) -> dict:
    return {k: v for k, v in tensors.items() if not (m := re.search(r"layers\.(\d+)\.", k)) or int(m[1]) < num_layers}


def cut_demo(out: Path, num_layers: int) -> dict[str, str]:
    """The demo cut to its first layers at `out`, and its adapters cut alike under out/adapters (name -> dir)."""
    for path in DEMO_DIR.iterdir():
        if path.is_file() and path.name not in ("model.safetensors", "config.json", "SHA256SUMS"):
            shutil.copy(path, out / path.name)
    config = json.loads((DEMO_DIR / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}))
    save_file(_first_layers(load_file(DEMO_DIR / "model.safetensors"), num_layers), out / "model.safetensors")
    cut = {}
    for name, path in demo_adapter_paths(str(DEMO_DIR)).items():
        cut[name] = out / "adapters" / name
        cut[name].mkdir(parents=True)
        shutil.copy(path / "adapter_config.json", cut[name])
        tensors = _first_layers(load_file(path / "adapter_model.safetensors"), num_layers)
        save_file(tensors, cut[name] / "adapter_model.safetensors")
    return {name: str(path) for name, path in cut.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="the draft's layers (the demo has 4)")
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    args = parser.parse_args()
    adapters = {name: str(path) for name, path in demo_adapter_paths(str(DEMO_DIR)).items()}
    lora_ids = {name: i for i, name in enumerate(adapters, start=1)}
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_DIR))
    names = [*adapters, None] * len(WORDS)
    prompts = [tokenizer(f"{words} =")["input_ids"] for words in WORDS for _ in range(len(adapters) + 1)]
    run = dict(adapters=adapters, names=names, lora_ids=lora_ids, lora_config=LORA_CONFIG)
    reference, _ = generate(str(DEMO_DIR), prompts, **run)
    labels = {lora_id: name for name, lora_id in lora_ids.items()}
    with tempfile.TemporaryDirectory() as tmp:
        draft_adapters = cut_demo(Path(tmp), args.layers)
        spec = {"method": "draft_model", "num_speculative_tokens": args.k, "model": tmp}
        for modules in ([], [f"{name}={path}" for name, path in draft_adapters.items()]):
            start = time.perf_counter()
            outputs, sched = generate(str(DEMO_DIR), prompts, spec, speculative_lora_modules=modules, **run)
            assert outputs == reference, "speculation changed a greedy output"
            rates = {labels.get(c.lora_id, "base"): f"{c.num_accepted_tokens / max(1, c.num_draft_tokens):.2f} "
                     f"({c.num_accepted_tokens}/{c.num_draft_tokens})" for c in sched.stats(op_id=0).spec}  # fmt: skip
            print(f"draft: demo cut to {args.layers} layers, k={args.k}, draft adapters {'on' if modules else 'off'}: "
                  f"acceptance {rates} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
