"""The PEFT baseline: the same workload served by transformers + peft, the best way peft allows.

    python -m scripts.bench.peft_baseline --size full --num-adapters 32 --batch-size 32 --num-requests 256

One PeftModel holds every adapter; each static batch of `--batch-size` requests (arrival order, as S-LoRA measured
its baselines; arrival times are ignored, every request is taken as queued at the start) is left-padded and
decoded greedily in one `generate(..., adapter_names=[...])` call that mixes adapters (`__base__` = no adapter).
A static batch runs until its longest member is done: min_new_tokens = max_new_tokens = the batch's longest
requested output. Only each request's requested tokens count as output, so throughputs are in the same units as
bench_serving's. A request's latency is the end of its batch.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from scripts.bench.model import DEFAULT_CACHE_DIR, SIZES, ensure_bench_model
from scripts.bench.report import SUMMARY_HEADERS, RequestResult, format_table, summarize, summary_rows, write_json
from scripts.bench.workload import BenchRequest, add_workload_args, make_workload, workload_spec_from_args

PAD_TOKEN_ID = 0  # <unk>; masked out, so its value does not matter
PEFT_BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in adapter_names


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_peft_model(base_dir: Path, adapter_dirs: dict[str, Path], dtype: str = "float32") -> torch.nn.Module:
    """Base and adapters in `dtype` (peft's default would upcast half-precision adapters to fp32 and run every LoRA
    matmul in fp32: slower, so the baseline keeps them in the model's dtype, as the server does)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=DTYPES[dtype]).eval()
    if not adapter_dirs:
        return model
    (first_name, first_dir), *rest = adapter_dirs.items()
    model = PeftModel.from_pretrained(model, first_dir, adapter_name=first_name, autocast_adapter_dtype=False).eval()
    for name, path in rest:
        model.load_adapter(path, adapter_name=name, autocast_adapter_dtype=False)
    return model


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), PAD_TOKEN_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask  # (batch, width) each


@torch.inference_mode()
def generate_batch(model: torch.nn.Module, batch: list[BenchRequest], use_adapters: bool) -> int:
    """Runs one static batch; returns the tokens generated per row (the batch's longest requested output)."""
    input_ids, attention_mask = left_pad([r.input_ids for r in batch])
    num_new_tokens = max(r.output_len for r in batch)
    kwargs = {}
    if use_adapters:
        kwargs["adapter_names"] = [r.adapter or PEFT_BASE_ADAPTER for r in batch]
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                            max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens,
                            pad_token_id=PAD_TOKEN_ID, **kwargs)
    generated = output.shape[1] - input_ids.shape[1]
    if generated != num_new_tokens:
        raise RuntimeError(f"peft generated {generated} tokens, expected {num_new_tokens}")
    return generated


def run_baseline(model: torch.nn.Module, requests: list[BenchRequest], batch_size: int, *, use_adapters: bool,
                 progress: bool = True) -> dict:
    from tqdm import tqdm

    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    generate_batch(model, [BenchRequest(0, r.input_ids[:8], 2, r.adapter, 0.0) for r in batches[0]], use_adapters)
    results, num_generated = [], 0
    run_start = time.perf_counter()
    for batch in tqdm(batches, desc="peft batches", disable=not progress, file=sys.stderr):
        num_generated += generate_batch(model, batch, use_adapters) * len(batch)
        end_s = time.perf_counter() - run_start
        for r in batch:
            results.append(RequestResult(r.index, r.adapter, len(r.input_ids), r.output_len,
                                         num_output_tokens=r.output_len, latency_s=end_s))
    duration_s = time.perf_counter() - run_start
    summary = summarize(results, duration_s)
    summary["generated_token_throughput"] = num_generated / duration_s  # padding rows included
    return {"summary": summary, "batch_size": batch_size, "num_batches": len(batches),
            "num_threads": torch.get_num_threads()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=32, help="static batch size (= the server's concurrency)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights and compute dtype")
    parser.add_argument("--size", choices=sorted(SIZES), default="full", help="bench model (scripts/bench/model.py)")
    parser.add_argument("--cache-dir", default=str(DEFAULT_CACHE_DIR))
    parser.add_argument("--model-path", default=None, help="a checkpoint instead of the bench model")
    parser.add_argument("--lora-paths", nargs="+", default=[], metavar="NAME=PATH",
                        help="with --model-path: the adapters the workload names")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--no-progress", action="store_true")
    add_workload_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    spec = workload_spec_from_args(args)
    requests = make_workload(spec)
    if args.model_path:
        base_dir = Path(args.model_path)
        all_dirs = {name: Path(path) for name, path in (p.split("=", 1) for p in args.lora_paths)}
    else:
        bench = ensure_bench_model(SIZES[args.size], len(spec.adapter_names), args.cache_dir)
        base_dir, all_dirs = bench.base_dir, bench.adapter_dirs
    used = sorted({r.adapter for r in requests if r.adapter is not None})
    missing = [name for name in used if name not in all_dirs]
    if missing:
        raise SystemExit(f"no adapter directory for {', '.join(missing)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_peft_model(base_dir, {name: all_dirs[name] for name in used}, args.dtype)
    result = run_baseline(model, requests, args.batch_size, use_adapters=bool(used), progress=not args.no_progress)
    result["config"] = {"model_path": str(base_dir), "dtype": args.dtype, "workload": spec.to_json()}
    print(format_table(SUMMARY_HEADERS, summary_rows("peft", result["summary"])))
    print(f"duration {result['summary']['duration_s']:.1f} s, generated incl. padding rows "
          f"{result['summary']['generated_token_throughput']:.1f} tok/s")
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
