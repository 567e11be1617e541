"""The benchmark checkpoint: a deterministic random Llama big enough that compute, not Python, dominates on CPU,
plus rank-16 all-module PEFT adapters (distinct seeds). Built once and cached; every benchmark reuses it.

    python -m scripts.bench.model --size full --num-adapters 33       # prints the base and adapter paths

Sizes (measured with HF on 2 CPU cores, fp32): `full` (137 M params) decodes a batch of 32 in ~120 ms and
prefills ~1.5 ms/token; `quick` (hidden 256, 4 layers) is for smoke runs. The other families' shapes (`qwen3`, with
its quick twin, and `qwen3_moe`, with rank-16 adapters on attention and every expert) serve
scripts/bench/families.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from loraplex.protocol.adapters.lora_targets import ATTN_MODULES, TARGET_MODULES

from tests.builders import build_lora_adapter, build_tiny_model
from tests.expert_adapters import build_expert_module_adapter

BENCH_VERSION = "bench-v1"  # bump when the builders below change what they write
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "loraplex" / BENCH_VERSION
ADAPTER_PREFIX = "lora-"
ADAPTER_RANK = 16
ADAPTER_ALPHA = 32


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    arch: str = "llama"  # tests/builders.py's Arch
    head_dim: int | None = None  # None: hidden_size // num_heads
    num_experts: int | None = None  # MoE archs: intermediate_size is each expert's (top-2 routing)

    @property
    def key(self) -> str:
        head_dim = "" if self.head_dim is None else f"-d{self.head_dim}"
        experts = "" if self.num_experts is None else f"-e{self.num_experts}"
        return (f"{self.arch}-h{self.hidden_size}-l{self.num_layers}-a{self.num_heads}-kv{self.num_kv_heads}"
                f"-i{self.intermediate_size}{head_dim}{experts}")


SIZES = {
    "full": ModelShape(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4, intermediate_size=2816),
    "quick": ModelShape(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=704),
    # Qwen3's proportions (Qwen3-8B: 32 heads of 128 over hidden 4096, 8 KV heads, intermediate 3 x hidden): q is
    # twice as wide as hidden, and each head's q and k are normed.
    "qwen3": ModelShape(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=8, intermediate_size=3072,
                        arch="qwen3", head_dim=128),
    "qwen3-quick": ModelShape(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=768,
                              arch="qwen3", head_dim=64),
    # Qwen3-MoE's proportions (Qwen3-30B-A3B: 8 of 128 experts of 768 over hidden 2048): fewer experts, so that the
    # weights fit a small machine; top-2 of 8 experts of 768 make about a third of the qwen3 row's MLP compute.
    "qwen3_moe": ModelShape(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=8, intermediate_size=768,
                            arch="qwen3_moe", head_dim=128, num_experts=8),
    "qwen3_moe-quick": ModelShape(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=256,
                                  arch="qwen3_moe", head_dim=64, num_experts=8),
}


@dataclass(frozen=True)
class BenchModel:
    base_dir: Path
    adapter_dirs: dict[str, Path]  # name -> PEFT adapter dir, in name order

    def first_adapters(self, num: int) -> dict[str, Path]:
        return {name: self.adapter_dirs[name] for name in tuple(self.adapter_dirs)[:num]}


def adapter_name(index: int) -> str:
    return f"{ADAPTER_PREFIX}{index:03d}"


def build_atomically(final_dir: Path, build) -> None:
    # A directory only appears by renaming a finished build, so existing == complete.
    if final_dir.is_dir():
        return
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    build_dir = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}-building-", dir=final_dir.parent))
    try:
        build(build_dir)
        try:
            os.rename(build_dir, final_dir)
        except OSError:
            if not final_dir.is_dir():  # else a concurrent build won; it is identical
                raise
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)


def ensure_bench_model(shape: ModelShape, num_adapters: int, cache_dir: str | os.PathLike[str] | None = None
                       ) -> BenchModel:
    root = Path(cache_dir or DEFAULT_CACHE_DIR) / shape.key
    base_dir = root / "base"
    build_atomically(base_dir, lambda out: build_tiny_model(
        out, arch=shape.arch, hidden_size=shape.hidden_size, num_layers=shape.num_layers, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, intermediate_size=shape.intermediate_size,
        num_experts=shape.num_experts, seed=0))
    adapter_dirs = {}
    for index in range(num_adapters):
        name = adapter_name(index)
        adapter_dirs[name] = root / "adapters" / name
        build_atomically(adapter_dirs[name], lambda out, seed=index + 1: build_adapter(shape, base_dir, out, seed))
    return BenchModel(base_dir, adapter_dirs)


def build_adapter(shape: ModelShape, base_dir: Path, out_dir: Path, seed: int) -> None:
    if shape.num_experts is None:
        build_lora_adapter(base_dir, out_dir, r=ADAPTER_RANK, lora_alpha=ADAPTER_ALPHA, target_modules=TARGET_MODULES,
                           seed=seed, base_model_name_or_path=str(base_dir))
    else:  # attention and every expert's MLP; std 0.1 keeps the rank-16 delta's scale near the base weights'
        build_expert_module_adapter(base_dir, out_dir, r=ADAPTER_RANK, lora_alpha=ADAPTER_ALPHA, seed=seed,
                                    attn_modules=ATTN_MODULES, init_std=0.1)


def main(argv: list[str] | None = None) -> BenchModel:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE_DIR))
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--num-adapters", type=int, default=33)
    parser.add_argument("--json", default=None, metavar="PATH", help="write {base_dir, adapter_dirs, shape} here")
    args = parser.parse_args(argv)
    shape = SIZES[args.size]
    model = ensure_bench_model(shape, args.num_adapters, args.cache_dir)
    print(f"base {model.base_dir}")
    for name, path in model.adapter_dirs.items():
        print(f"{name} {path}")
    if args.json:
        Path(args.json).write_text(json.dumps({"base_dir": str(model.base_dir), "shape": asdict(shape),
                                               "adapter_dirs": {k: str(v) for k, v in model.adapter_dirs.items()}},
                                              indent=2) + "\n")
    return model


if __name__ == "__main__":
    main()
