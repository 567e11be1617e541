"""The pooling runner's throughput against sentence-transformers on the same model and texts, in the same run.

    python -m scripts.bench.pooling                 # qwen3 shape (hidden 1024, 12 layers), 8 adapters
    python -m scripts.bench.pooling --quick --json out.json
    python -m scripts.bench.pooling --quick --chunked-prefill-size 512   # the server cuts prompts into 512-token passes

A sentence-transformers directory (Qwen3 decoder, last-token pooling, Normalize; tests/pooling_models.py) with 8
rank-16 adapters, served by one server. Texts of 64-128 tokens. Rows (texts embedded per second):
- `batch1`: one text per request, one request at a time; sentence-transformers: encode() of one text at a time;
- `batch64`: 64 texts in one request; sentence-transformers: encode() of the 64 with batch_size 64;
- `adapters8`: 64 texts as 8 concurrent requests of 8, each on its own adapter (one batch across adapters);
  sentence-transformers has no per-text adapter: its figure is the base model's batch64 again.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch

from scripts.bench.server import NUM_CORES, server_env
from tests.builders import build_lora_adapter
from tests.pooling_models import build_st_embedder
from tests.server_utils import ServerProcess

SHAPES = {
    "full": dict(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=8, intermediate_size=3072, head_dim=128),
    "quick": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=768, head_dim=64),
}
NUM_ADAPTERS = 8
WORDS = "the morning was cold and clear and the old farmer walked slowly down the lane toward river".split()


def texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(48, 96))) for _ in range(count)]


def rate(count: int, run) -> float:
    start = time.perf_counter()
    run()
    return count / (time.perf_counter() - start)


def embed(url: str, model: str, inputs: list[str]) -> None:
    resp = requests.post(url + "/v1/embeddings", json={"model": model, "input": inputs}, timeout=600)
    resp.raise_for_status()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--num-texts", type=int, default=64)
    parser.add_argument("--server-threads", type=int, default=NUM_CORES)
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--chunked-prefill-size", type=int, default=None, metavar="N",
                        help="the server's (default: its own, the pooling runner's --max-prefill-tokens)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.server_threads or NUM_CORES)
    size = "quick" if args.quick else "full"
    work = Path(tempfile.mkdtemp(prefix="loraplex-bench-pooling-"))
    model_dir = work / "embedder"
    causal = build_st_embedder(model_dir, **SHAPES[size])
    adapters = {f"lora-{i}": work / f"lora-{i}" for i in range(NUM_ADAPTERS)}
    for seed, path in enumerate(adapters.values(), start=1):
        build_lora_adapter(causal, path, r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                           "o_proj", "gate_proj", "up_proj", "down_proj"], seed=seed)  # fmt: skip
    batch = texts(args.num_texts, seed=0)
    ones = batch[:16]
    results: dict[str, dict[str, float]] = {}
    chunking = ["--chunked-prefill-size", str(args.chunked_prefill_size)] if args.chunked_prefill_size else []
    with ServerProcess("--model-path", str(model_dir), "--dtype", "float32", "--max-loras-per-batch",
                       str(NUM_ADAPTERS), "--lora-paths", *[f"{n}={p}" for n, p in adapters.items()],
                       *chunking, env=server_env(args.server_threads), start_timeout_s=600) as server:  # fmt: skip
        embed(server.url, "embedder", batch[:2])  # warm
        per_adapter = [batch[i::NUM_ADAPTERS] for i in range(NUM_ADAPTERS)]

        def eight() -> None:
            with ThreadPoolExecutor(NUM_ADAPTERS) as pool:
                list(pool.map(lambda k: embed(server.url, f"lora-{k}", per_adapter[k]), range(NUM_ADAPTERS)))

        results["loraplex"] = {
            "batch1": rate(len(ones), lambda: [embed(server.url, "embedder", [t]) for t in ones]),
            "batch64": rate(len(batch), lambda: embed(server.url, "embedder", batch)),
            "adapters8": rate(len(batch), eight),
        }
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_dir), device="cpu")
    st.encode(batch[:2])  # warm
    st64 = rate(len(batch), lambda: st.encode(batch, batch_size=len(batch)))
    results["sentence_transformers"] = {
        "batch1": rate(len(ones), lambda: [st.encode([t], batch_size=1) for t in ones]),
        "batch64": st64,
        "adapters8": st64,  # the base model only: it has no per-text adapter
    }
    report = {"size": size, "num_texts": len(batch), "texts_per_s": results,
              "ratio": {k: results["loraplex"][k] / results["sentence_transformers"][k] for k in results["loraplex"]}}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
