"""Speculative decoding on the trained demo model: none / n-gram drafts / a draft model, 1 and 8 streams, per workload.

    python -m scripts.bench speculative                  # full: k = 4, 6 requests a stream
    python -m scripts.bench speculative --quick --json out.json

The target is the built-in demo (frontend/demo_assets: 4 layers, trained on tests/demo_tasks.py's tasks: `words =`
and the answer, then EOS) with its three adapters. Workloads: repetitive, the base model's echo and the reverse
adapter's word order, whose answers copy the prompt's words (the shape of quoting or editing a given text: n-gram
lookup finds them); new text, the sort and mirror adapters, whose answers (each word's letters sorted, or spelt
backwards) are not in the prompt. Greedy requests, each to its own EOS: a probe on each server first
gives every answer's length, and the requests ask for exactly that many tokens; every side's probe outputs are
compared with those without speculation (equal in float32; the result says so per run).

Sides, one server each, started one after the other with the same flags but their own: off; ngram (`prompt_lookup_min`
1, max 4); draft_model, the demo cut to its first DRAFT_LAYERS layers with each adapter cut alike as its draft adapter
(--speculative-lora-modules; scripts/bench/spec_acceptance.py's cut). EAGLE-3 is not measured: there is no head trained
for the demo. Ratios: output throughput against the side without speculation, measured in the same run; the notes
carry the acceptance rate and the mean tokens per verify pass of the run (from /server_info).

With `--llama-cpp DIR` (a llama.cpp tree with build/bin/llama-server; scripts/bench/spec_llama_cpp.py) llama-server
runs the same sides after loraplex's, on the demo converted to GGUF at the same dtype, the same prompts, output lengths
(ignore_eos) and k: no speculation, its n-gram lookup, and the cut demo as its draft model (without adapters: llama.cpp
has no draft adapters). More rows: loraplex / llama-server output throughput per side, workload and streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

from loraplex.frontend.demo import DEMO_DIR, demo_adapter_paths
from transformers import AutoTokenizer

import scripts.bench.serving as bench_serving
import scripts.bench.spec_llama_cpp as spec_llama
from scripts.bench.llama_cpp import start_llama_server
from scripts.bench.report import Targets, best_of, summarize, versus
from scripts.bench.server import NUM_CORES, server_env
from scripts.bench.spec_acceptance import cut_demo
from scripts.bench.workload import BenchRequest
from tests.demo_tasks import prompt, random_input
from tests.server_utils import ServerProcess

USES_BENCH_MODEL = False  # the demo model, not the random bench model (scripts/bench/ratios.py)
DRAFT_LAYERS = 2  # of the demo's 4
MAX_ANSWER_TOKENS = 32  # the longest demo answer (20 characters) and EOS fit


@dataclass(frozen=True)
class Plan:
    size: str
    requests_per_stream: int
    num_speculative_tokens: int

    @property
    def num_adapters(self) -> int:
        return len({name for models in WORKLOADS.values() for name in models if name is not None})


FULL = Plan(size="full", requests_per_stream=6, num_speculative_tokens=4)
QUICK = Plan(size="quick", requests_per_stream=3, num_speculative_tokens=3)

# workload -> the models its requests go to, in turn (None: the base model)
WORKLOADS: dict[str, tuple[str | None, ...]] = {"repetitive": (None, "reverse"), "new_text": ("sort", "mirror")}
STREAMS = (1, 8)
METHODS = ("ngram", "draft_model")
WORDS = {"repetitive": "echo / reverse the words", "new_text": "sort letters / mirror words"}

TARGETS: Targets = {
    f"spec_{method}_{workload}_{streams}": (
        f"throughput, {method} / no speculation, demo {WORDS[workload]}, {streams} stream(s)", target, check)
    for method in METHODS
    for workload, (target, check) in (("repetitive", (">= 1.2", lambda v: v >= 1.2)),
                                      ("new_text", (">= 0.8", lambda v: v >= 0.8)))
    for streams in STREAMS
}  # fmt: skip

# With --llama-cpp: loraplex / llama-server per side (ratios.py shows them when measured). No target: the issue asks
# for the figures beside each other.
SIDE_WORDS = {"off": "no speculation", "ngram": "n-gram lookup",
              "draft_model": "draft model (loraplex: with draft adapters; llama.cpp: no adapter on its draft)"}
OPTIONAL_TARGETS: Targets = {
    f"llama_{side}_{workload}_{streams}": (
        f"throughput, loraplex / llama-server, {SIDE_WORDS[side]}, demo {WORDS[workload]}, {streams} stream(s)",
        "none", None)
    for side in spec_llama.SIDES for workload in WORKLOADS for streams in STREAMS
}  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> list[str]:
    """This benchmark's own options (scripts/bench/ratios.py passes them to `benchmark`)."""
    parser.add_argument("--llama-cpp", type=Path, default=None, metavar="DIR",
                        help="also run llama-server's sides (a llama.cpp tree with build/bin/llama-server)")
    return ["llama_cpp"]


def prompts(plan: Plan, workload: str, streams: int, seed: int) -> list[tuple[list[int], str | None]]:
    """(prompt ids, model) of one run: demo inputs the training never saw the order of, the models in turn."""
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_DIR))
    rng = random.Random(f"{seed}-{workload}-{streams}")
    models = WORKLOADS[workload]
    return [(tokenizer(prompt(random_input(rng)))["input_ids"], models[i % len(models)])
            for i in range(plan.requests_per_stream * streams)]  # fmt: skip


def probe(srv: ServerProcess, runs: list[tuple[list[int], str | None]]) -> list[list[int]]:
    """Every prompt's greedy output to its EOS, in one batch (it also warms the server up)."""
    body = {"input_ids": [ids for ids, _ in runs], "lora_path": [model for _, model in runs],
            "sampling_params": {"max_new_tokens": MAX_ANSWER_TOKENS, "temperature": 0.0}}  # fmt: skip
    resp = srv.post("/generate", body, timeout=600)
    resp.raise_for_status()
    return [item["output_ids"] for item in resp.json()]


# Each request to its EOS: max_new_tokens is the answer's length the probe found, so every side decodes the same tokens.
TO_EOS = bench_serving.Wire("/generate", lambda r: {
    "input_ids": r.input_ids, "lora_path": r.adapter, "stream": True,
    "sampling_params": {"max_new_tokens": r.output_len, "temperature": 0.0}},
    lambda chunk: len(chunk["output_ids"]))  # fmt: skip


def run(url: str, runs: list[tuple[list[int], str | None]], lengths: list[int], streams: int, desc: str,
        wire: bench_serving.Wire = TO_EOS) -> dict:  # fmt: skip
    requests = [BenchRequest(index=i, input_ids=ids, output_len=n, adapter=model, arrival_s=0.0)
                for i, ((ids, model), n) in enumerate(zip(runs, lengths, strict=True))]  # fmt: skip
    results, duration_s = asyncio.run(bench_serving.run_requests(url, requests, concurrency=streams, progress=False,
                                                                 desc=desc, wire=wire))  # fmt: skip
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{desc}: {len(failed)} of {len(results)} requests failed; first: {failed[0].error}")
    summary = summarize(results, duration_s)
    print(f"{desc}: {summary['output_token_throughput']:.1f} out tok/s", flush=True)
    return {"summary": summary}


def spec_counts(url: str) -> tuple[int, int, int]:
    """(drafted, accepted, verify passes) so far, over every adapter."""
    info = asyncio.run(bench_serving.get_json(url, "/server_info"))["speculative"]
    return tuple(sum(a[key] for a in info["adapters"])
                 for key in ("num_draft_tokens", "num_accepted_tokens", "num_verify_passes"))  # type: ignore[return-value]


def server(extra: list[str], dtype: str, server_threads: int) -> ServerProcess:
    adapters = [f"{name}={path}" for name, path in demo_adapter_paths(str(DEMO_DIR)).items()]
    return ServerProcess("--model-path", str(DEMO_DIR), "--dtype", dtype, "--lora-paths", *adapters,
                         "--max-loras-per-batch", str(len(adapters)), "--max-running-requests", str(max(STREAMS)),
                         *extra, env=server_env(server_threads), start_timeout_s=600)  # fmt: skip


def benchmark(bench: object, plan: Plan, *, dtype: str, server_threads: int, repeats: int, seed: int,
              llama_cpp: Path | None = None) -> dict:  # fmt: skip
    """`bench` is unused: the demo model is the target (USES_BENCH_MODEL). `llama_cpp`: also llama-server's sides."""
    results: dict = {"plan": plan.__dict__, "eagle3": "not measured: no EAGLE-3 head for the demo model",
                     "llama_cpp": str(llama_cpp) if llama_cpp else "not run (--llama-cpp DIR)"}  # fmt: skip
    runs = {(w, s): prompts(plan, w, s, seed) for w in WORKLOADS for s in STREAMS}
    reference: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        draft_adapters = cut_demo(Path(tmp), DRAFT_LAYERS)
        k = plan.num_speculative_tokens
        sides = {
            "off": [],
            "ngram": ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": k,
                                                          "prompt_lookup_min": 1, "prompt_lookup_max": 4})],
            "draft_model": ["--speculative-config", json.dumps({"method": "draft_model", "model": tmp,
                                                                "num_speculative_tokens": k}),
                            "--speculative-lora-modules", *(f"{n}={p}" for n, p in draft_adapters.items())],
        }  # fmt: skip
        for side, extra in sides.items():
            with server(extra, dtype, server_threads) as srv:
                for key, key_runs in runs.items():
                    outputs = probe(srv, key_runs)
                    workload, streams = key
                    # in fp32 they are equal (asserted by the tests); bf16 may round a verify row differently
                    same = reference.setdefault(key, outputs) == outputs
                    results[f"{side}_{workload}_{streams}_outputs_equal"] = same
                    if not same:
                        print(f"{side}, {workload}, {streams} stream(s): greedy outputs differ from those without "
                              f"speculation (--dtype {dtype})", flush=True)  # fmt: skip
                    before = spec_counts(srv.url)
                    lengths = [len(o) for o in outputs]
                    best = best_of([run(srv.url, key_runs, lengths, streams, f"{side}, {workload}, {streams} stream(s)")
                                    for _ in range(repeats)])  # fmt: skip
                    drafted, accepted, passes = (a - b for a, b in zip(spec_counts(srv.url), before, strict=True))
                    best["acceptance_rate"] = accepted / max(1, drafted)
                    best["mean_accepted_length"] = 1 + accepted / max(1, passes)
                    results[f"{side}_{workload}_{streams}"] = best
        if llama_cpp is not None:
            results.update(llama_sides(llama_cpp.resolve(), Path(tmp), plan, runs, reference, dtype=dtype,
                                       threads=server_threads or NUM_CORES, repeats=repeats))  # fmt: skip
    results["measured"] = measure_ratios(results)
    return results


def llama_sides(llama_cpp: Path, draft_dir: Path, plan: Plan, runs: dict, reference: dict, *, dtype: str,
                threads: int, repeats: int) -> dict:  # fmt: skip
    """llama-server's sides on the same prompts and output lengths as loraplex's (`reference`: its greedy outputs
    without speculation): results keys `llama_{side}_{workload}_{streams}`."""
    adapter_dirs = demo_adapter_paths(str(DEMO_DIR))
    adapter_ids = {name: i for i, name in enumerate(adapter_dirs)}
    eos = AutoTokenizer.from_pretrained(str(DEMO_DIR)).eos_token_id
    gguf = spec_llama.convert_demo(llama_cpp, DEMO_DIR, adapter_dirs, draft_dir, draft_dir / "gguf", dtype)
    results: dict = {}
    for side in spec_llama.SIDES:
        flags = spec_llama.side_flags(side, plan.num_speculative_tokens, gguf.draft)
        with start_llama_server(llama_cpp, gguf.base, list(gguf.adapters.values()), threads=threads,
                                slots=max(STREAMS), extra=flags) as srv:  # fmt: skip
            for key, key_runs in runs.items():
                workload, streams = key
                tokens = asyncio.run(spec_llama.greedy_tokens(srv.url, key_runs, adapter_ids, MAX_ANSWER_TOKENS,
                                                              max(STREAMS)))  # fmt: skip
                # llama-server's greedy answers against loraplex's: the conversion's check (equal in float32)
                equal = sum(spec_llama.without_eos(ours, eos) == spec_llama.without_eos(theirs, eos)
                            for ours, theirs in zip(reference[key], tokens, strict=True))  # fmt: skip
                results[f"llama_{side}_{workload}_{streams}_outputs_equal"] = f"{equal}/{len(tokens)}"
                if equal < len(tokens):
                    print(f"llama-server {side}, {workload}, {streams} stream(s): {len(tokens) - equal} of "
                          f"{len(tokens)} greedy answers differ from loraplex's (--dtype {dtype})", flush=True)
                timings: list[dict] = []
                wire = spec_llama.timed_wire(adapter_ids, timings)
                lengths = [len(o) for o in reference[key]]
                best = best_of([run(srv.url, key_runs, lengths, streams, f"llama-server {side}, {workload}, "
                                    f"{streams} stream(s)", wire) for _ in range(repeats)])  # fmt: skip
                drafted, accepted = spec_llama.acceptance(timings)
                best["acceptance_rate"] = accepted / max(1, drafted)
                results[f"llama_{side}_{workload}_{streams}"] = best
    return results


def measure_ratios(results: dict) -> dict[str, tuple[float, str]]:
    measured = {}
    for method in METHODS:
        for workload in WORKLOADS:
            for streams in STREAMS:
                on, off = results[f"{method}_{workload}_{streams}"], results[f"off_{workload}_{streams}"]
                note = f" (acceptance {on['acceptance_rate']:.0%}, {on['mean_accepted_length']:.2f} tokens a pass)"
                measured[f"spec_{method}_{workload}_{streams}"] = versus(
                    on["summary"]["output_token_throughput"], off["summary"]["output_token_throughput"], "out tok/s",
                    note=note)  # fmt: skip
    for key in OPTIONAL_TARGETS:
        if key not in results:
            continue
        ours, theirs = results[key.removeprefix("llama_")], results[key]
        note = "" if key.startswith("llama_off_") else (
            f" (acceptance {ours['acceptance_rate']:.0%} vs {theirs['acceptance_rate']:.0%})")
        measured[key] = versus(ours["summary"]["output_token_throughput"],
                               theirs["summary"]["output_token_throughput"], "out tok/s", note=note)  # fmt: skip
    return measured
