"""A hybrid model's decode step beside a dense one of equal parameters, in process (no server).

The hybrid is Qwen3.5-text-shaped (three Gated DeltaNet layers per gated attention layer); the dense model is
Qwen3-shaped with the same hidden size, layers and attention heads, its MLP widened until the two have the same
parameter count. Both start with `--load-format dummy` weights in one ModelRunner each; the largest batch of requests
of `context` tokens is prefilled, then for each batch the same decode step of its first requests is timed over and
over, alternating the two models step by step so both see the same machine. Prints min and median step time per
model and batch, and hybrid / dense.

    python -m scripts.bench.hybrid_decode                    # bfloat16, batches 1, 8, 32, context 256
    python -m scripts.bench.hybrid_decode --batches 1 8 --steps 4 --json out.json

`scripts.bench families` runs the same measurement (`measure`) for its hybrid rows; its --quick run on QUICK_SHAPES.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import ForwardBatch, ForwardReq, SamplingParams
from loraplex.worker.model_runner import ModelRunner

from scripts.bench.report import write_json

PAGE_SIZE = 16
GREEDY = SamplingParams(temperature=0.0)
COMMON = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
              head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip
HYBRID = dict(COMMON, intermediate_size=3072, linear_num_key_heads=8, linear_num_value_heads=16,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
              mamba_ssm_dtype="float32")  # fmt: skip  (as Qwen3.5 publishes: states in float32)
SHAPES = (COMMON, HYBRID)
# a smoke run's: 4 layers (3 DeltaNet, 1 attention), hidden 128
_QUICK_COMMON = dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
QUICK_SHAPES = (_QUICK_COMMON, dict(_QUICK_COMMON, intermediate_size=256, linear_num_key_heads=2,
                                    linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                                    linear_conv_kernel_dim=4, mamba_ssm_dtype="float32"))  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="running requests per step")
    parser.add_argument("--context", type=int, default=256, help="tokens each request has before the steps")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per model and batch")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def num_parameters(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def write_models(root: Path, shapes: tuple[dict, dict] = SHAPES) -> dict[str, tuple[Path, int]]:
    """The two model directories (config.json only) and their parameter counts; `shapes`: (the fields both share,
    the hybrid's)."""
    from transformers import Qwen3_5TextConfig, Qwen3Config

    common, hybrid_fields = shapes
    hybrid = Qwen3_5TextConfig(**hybrid_fields)
    target = num_parameters(hybrid)
    # Dense: the same model but for its MLP, widened to the hybrid's parameter count (a multiple of 64).
    base = num_parameters(Qwen3Config(**common, intermediate_size=64))
    per_unit = num_parameters(Qwen3Config(**common, intermediate_size=128)) - base  # per 64 more intermediate
    dense = Qwen3Config(**common, intermediate_size=64 + 64 * round((target - base) / per_unit))
    out = {}
    for name, config in (("hybrid", hybrid), ("dense", dense)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config.to_dict()))
        out[name] = (root / name, num_parameters(config))
    return out


def prefilled_runner(model_dir: Path, dtype: str, batch: int, context: int) -> tuple[ModelRunner, list[ForwardReq]]:
    """A runner with `batch` requests prefilled in one pass; their next decode step's ForwardReqs (a step may take
    any first n of them)."""
    pages_per_req = -(-(context + 1) // PAGE_SIZE)
    config = ServerConfig(device="cpu", dtype=dtype, load_format="dummy", page_size=PAGE_SIZE,
                          max_total_tokens=batch * pages_per_req * PAGE_SIZE, max_running_requests=batch)  # fmt: skip
    runner = ModelRunner(config, str(model_dir), rank=0, world_size=1, device="cpu")
    gen = torch.Generator().manual_seed(0)
    pages = [list(range(i * pages_per_req, (i + 1) * pages_per_req)) for i in range(batch)]
    prompts = torch.randint(0, runner.vocab_size, (batch, context), generator=gen).tolist()
    tokens = runner.forward(ForwardBatch(batch_id=0, reqs=[
        ForwardReq(input_ids=prompts[i], num_cached_tokens=0, page_ids=pages[i], sampling=GREEDY, req_key=i,
                   state_slot=i) for i in range(batch)]))  # fmt: skip
    steps = [ForwardReq(input_ids=[tokens[i]], num_cached_tokens=context, page_ids=pages[i], req_key=i,
                        num_generated=1, state_slot=i) for i in range(batch)]  # fmt: skip
    return runner, steps


def measure(models: dict[str, tuple[Path, int]], batches: list[int], context: int, steps: int,
            dtype: str) -> list[dict]:  # fmt: skip
    """One row per batch: min and median step time of each model (ms), and hybrid / dense of the medians. One runner
    per model holds the largest batch; a smaller one steps its first requests."""
    rows = []
    runners = {name: prefilled_runner(path, dtype, max(batches), context) for name, (path, _) in models.items()}
    for batch in batches:
        times: dict[str, list[float]] = {name: [] for name in runners}
        for step in range(steps + 1):  # the first of each is a warm-up
            for name, (runner, reqs) in runners.items():
                start = time.perf_counter()
                runner.forward(ForwardBatch(batch_id=10_000 + step, reqs=reqs[:batch]))  # the same step again
                if step:
                    times[name].append((time.perf_counter() - start) * 1e3)
        row = {"batch": batch, **{f"{name}_{stat}_ms": round(fn(t), 2) for name, t in times.items()
                                  for stat, fn in (("min", min), ("median", statistics.median))}}  # fmt: skip
        row["hybrid_over_dense"] = round(row["hybrid_median_ms"] / row["dense_median_ms"], 2)
        rows.append(row)
        print(f"batch {batch:3d}: hybrid {row['hybrid_min_ms']:.2f} / {row['hybrid_median_ms']:.2f} ms, dense "
              f"{row['dense_min_ms']:.2f} / {row['dense_median_ms']:.2f} ms (min / median), hybrid / dense "
              f"{row['hybrid_over_dense']}")
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        models = write_models(Path(tmp))
        print(f"parameters: hybrid {models['hybrid'][1] / 1e6:.1f} M, dense {models['dense'][1] / 1e6:.1f} M")
        rows = measure(models, args.batches, args.context, args.steps, args.dtype)
    if args.json:
        write_json(args.json, {"parameters": {name: n for name, (_, n) in models.items()}, "rows": rows})


if __name__ == "__main__":
    main()
