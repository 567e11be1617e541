"""Image requests through a server: time to first token and throughput, with the prefix cache on and off, and the
time an image adds to a request.

    python -m scripts.bench.vision                        # the tests' tiny Qwen2.5-VL, 32 concurrent, 4 adapters
    python -m scripts.bench.vision --quick --json out.json   # prints a table; the JSON has every figure
    python -m scripts.bench.vision --model-path DIR       # a vision-language checkpoint the workers serve

Without --model-path the model is the tests' tiny Qwen2.5-VL (tests/vision_models.py: the frontend's whole image
path — fetch, decode, the checkpoint's image processor, placeholders — the workers' vision tower and the prefill)
with 4 rank-8 adapters on its language model. Each request is a chat with one 64x64 PNG
as a data: URL and a short question, greedy, 16 new tokens, streamed. Rows, for each of prefix cache on and off:
- `single`: one request at a time, the same image each time (TTFT's median; with the cache on, the image's pages
  are shared after the first);
- `concurrent`: 32 requests at once (8 with --quick), round-robin over the base model and the adapters, over 4
  images (TTFT's median and 90th percentile, output tokens per second, requests per second);
- `image_cost_ms`: the single requests' median TTFT less the same chat's without the image (cache off): the
  frontend's work on one image and its placeholders' prefill (the encoder's too, on a model that has one). Where the
  server's /metrics has a series named `*encoder*` (a worker's vision encoder), its values are reported as well.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from scripts.bench.report import format_table, write_json
from scripts.bench.server import NUM_CORES, server_env
from tests.server_utils import ServerProcess
from tests.vision_models import build_qwen2_5_vl, png_bytes
from tests.vision_models import test_image as random_image
from tests.vision_requests import build_vl_adapter

NUM_ADAPTERS = 4
MAX_TOKENS = 16
QUESTION = "what is in this picture?"


def image_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(random_image(64, 64, seed=seed))).decode()


def chat(url: str, model: str, image: str | None) -> tuple[float, int]:
    """One streamed chat: (seconds to its first content, completion tokens)."""
    content = [{"type": "text", "text": QUESTION}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, tokens = None, 0
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (first if first is not None else time.perf_counter() - start), tokens


def encoder_series(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=30).text
    return {line.split(" ")[0]: float(line.split(" ")[-1]) for line in text.splitlines()
            if "encoder" in line and not line.startswith("#")}  # fmt: skip


def measure(url: str, models: list[str], num_concurrent: int, num_single: int) -> dict:
    same = image_url(0)
    chat(url, models[0], same)  # warm: the first request pays for imports and the pool's threads
    # ... and the first burst for the rest of the frontend's image threads and the workers' first batch shapes (on
    # other images, so that it leaves none of the measured ones cached): the server measured first paid it alone
    with ThreadPoolExecutor(num_concurrent) as pool:
        list(pool.map(lambda k: chat(url, models[k % len(models)], image_url(100 + k)), range(num_concurrent)))
    single = [chat(url, models[0], same)[0] for _ in range(num_single)]
    text_only = [chat(url, models[0], None)[0] for _ in range(num_single)]
    images = [image_url(seed) for seed in range(1, 5)]
    jobs = [(models[k % len(models)], images[k % len(images)]) for k in range(num_concurrent)]
    start = time.perf_counter()
    with ThreadPoolExecutor(num_concurrent) as pool:
        results = list(pool.map(lambda job: chat(url, *job), jobs))
    elapsed = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)
    return {
        "single_ttft_ms": 1000 * statistics.median(single),
        "text_only_ttft_ms": 1000 * statistics.median(text_only),
        "image_cost_ms": 1000 * (statistics.median(single) - statistics.median(text_only)),
        "concurrent_ttft_p50_ms": 1000 * ttfts[len(ttfts) // 2],
        "concurrent_ttft_p90_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "concurrent_tokens_per_s": sum(r[1] for r in results) / elapsed,
        "concurrent_requests_per_s": len(results) / elapsed,
        "encoder_metrics": encoder_series(url),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model-path", default=None,
                        help="a vision-language checkpoint (default: the tests' tiny Qwen2.5-VL)")
    parser.add_argument("--server-threads", type=int, default=NUM_CORES)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    num_concurrent, num_single = (8, 3) if args.quick else (32, 8)
    work = Path(tempfile.mkdtemp(prefix="loraplex-bench-vision-"))
    model_args: list[str] = ["--served-model-name", "vl"]
    models = ["vl"]
    if args.model_path:
        model_args += ["--model-path", args.model_path]
    else:
        model_dir = work / "base"
        build_qwen2_5_vl(model_dir)
        adapters = {f"lora-{i}": work / f"lora-{i}" for i in range(NUM_ADAPTERS)}
        for seed, path in enumerate(adapters.values(), start=1):
            build_vl_adapter(model_dir, path, 8, 16, ("q_proj", "v_proj"), seed)
        model_args += ["--model-path", str(model_dir), "--max-loras-per-batch", str(NUM_ADAPTERS + 1),
                       "--lora-paths", *[f"{n}={p}" for n, p in adapters.items()]]  # fmt: skip
        models += list(adapters)
    results = {}
    for cache, extra in (("cache_on", []), ("cache_off", ["--disable-radix-cache"])):
        with ServerProcess(*model_args, *extra, "--max-running-requests", str(num_concurrent), "--dtype", "float32",
                           env=server_env(args.server_threads), start_timeout_s=600) as server:  # fmt: skip
            results[cache] = measure(server.url, models, num_concurrent, num_single)
    report = {"model": args.model_path or "tiny Qwen2.5-VL (tests/vision_models.py)", "quick": args.quick,
              "num_concurrent": num_concurrent, "max_tokens": MAX_TOKENS, "results": results}  # fmt: skip
    print(f"{report['model']}, {num_concurrent} at once, {MAX_TOKENS} tokens each")
    print(table(results, num_concurrent))
    if args.json:
        write_json(args.json, report)
    return report


def table(results: dict[str, dict], num_concurrent: int) -> str:
    """One row per prefix-cache setting, as BENCHMARKS.md shows them."""
    headers = ["prefix cache", "single TTFT ms", "text-only TTFT ms", "image cost ms",
               f"{num_concurrent} at once: TTFT p50 ms", "TTFT p90 ms", "tokens/s", "requests/s"]  # fmt: skip
    keys = ["single_ttft_ms", "text_only_ttft_ms", "image_cost_ms", "concurrent_ttft_p50_ms",
            "concurrent_ttft_p90_ms", "concurrent_tokens_per_s", "concurrent_requests_per_s"]  # fmt: skip
    return format_table(headers, [[name.removeprefix("cache_"), *(run[k] for k in keys)] for name, run in
                                  results.items()])  # fmt: skip


if __name__ == "__main__":
    main()
