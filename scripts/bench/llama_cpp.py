"""loraplex beside llama.cpp's server on the bench model's weights at bf16, 8 and 4 bits, with its 32 adapters.

    python -m scripts.bench.llama_cpp --llama-cpp DIR [--rounds 2] [--workloads single,adapters] [--json out.json]

DIR is a llama.cpp source tree with `build/bin/llama-server` and `build/bin/llama-quantize` built
(docs/BENCHMARKS.md says how). Both servers serve the bench model (scripts/bench/model.py, full size) and its 32
rank-16 adapters on every linear:

  precision  loraplex                                      llama-server
  bf16       the checkpoint as written                     GGUF bf16 (convert_hf_to_gguf.py)
  8-bit      compressed-tensors INT8 per channel (W8A16)   Q8_0 (llama-quantize; blocks of 32)
  4-bit      GPTQ INT4 in groups of 128 (W4A16)            Q4_0 (llama-quantize; blocks of 32)

Adapters are the same PEFT files, converted for llama.cpp by its convert_lora_to_gguf.py (bf16); the conversions are
written once next to the bench model. The bench tokenizer has no sentencepiece model and a pre-tokenizer llama.cpp
does not know: the conversion is told both (prompts are token ids, so the tokenizer never runs).

One server at a time, the two alternating which goes first per precision and round, each running two workloads with
token-id prompts and exact output lengths (ignore_eos): single stream (one request after another, prompt 64,
output 128, four adapters in turn: decode tokens/s from the inter-token gaps) and 32 adapters (the project's
workload: in/out 16-256, 32 concurrent, uniform over the 32 adapters: output tokens/s, TTFT p99). Both use every core
for compute. llama-server runs `--lora A,B,... --lora-init-without-apply -np 32 --cont-batching --cache-ram 0`; every
adapter's global scale is set to 0 after start, and each request names its own (`"lora": [{"id": k, "scale": 1}]`),
so it batches only requests on the same adapter. The adapters go as one comma-separated `--lora` list, as current
llama.cpp reads it. A llama-server that dies at start (on some CPUs its repacked Q8_0/Q4_0 kernels crash at load) is
started again with `--no-repack`, and the table's rows for that precision say so. Ratios: loraplex / llama-server,
best of the rounds on each side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import requests

import scripts.bench.quantized as bench_quantized
from scripts.bench.model import SIZES, BenchModel, ensure_bench_model
from scripts.bench.peer_process import PeerProcess
from scripts.bench.report import format_table, write_json
from scripts.bench.server import NUM_CORES, start_server
from scripts.bench.serving import LORAPLEX, Wire, run_workloads, warm_up
from scripts.bench.workload import BenchRequest, WorkloadSpec, make_workload
from tests.net import free_port

PRECISIONS = {"bf16": ("plain", "BF16"), "8-bit": ("int8", "Q8_0"), "4-bit": ("int4", "Q4_0")}  # loraplex, GGUF
HEADERS = ("workload", "loraplex / llama-server", "loraplex vs llama-server")
WORKLOADS = ("single", "adapters")
CONTEXT_PER_SLOT = 640  # the workload's longest request (256 + 256) fits a llama-server slot
START_TIMEOUT_S = 600.0

# Run inside llama.cpp's tree: its converters, told that the bench tokenizer is tokenizer.json only (no
# sentencepiece model) and to take GPT-2's pre-tokenizer for a hash it does not list. A BPE without merges (the
# demo's: one token a character) gets one merge that never applies: llama.cpp refuses a BPE vocabulary without the
# merges key, and the converter writes none for an empty list.
CONVERT = """
import runpy, sys
import gguf
from conversion import base
def tokenizer_json_only(self):
    raise FileNotFoundError("no tokenizer.model")
base.TextModel._set_vocab_sentencepiece = tokenizer_json_only
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
add_to_gguf = gguf.SpecialVocab.add_to_gguf
def with_a_merge(self, *args, **kwargs):
    if self.load_merges and not self.merges:
        self.merges = ["\u0120 \u0120"]
    add_to_gguf(self, *args, **kwargs)
gguf.SpecialVocab.add_to_gguf = with_a_merge
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclass(frozen=True)
class Plan:
    single_requests: int  # one after another
    single_output: int
    num_requests: int  # the 32-adapter workload
    num_adapters: int = 32


FULL = Plan(single_requests=8, single_output=128, num_requests=64)
QUICK = Plan(single_requests=2, single_output=16, num_requests=8, num_adapters=4)


def llama_cpp_wire(adapter_ids: dict[str, int]) -> Wire:
    """llama-server's streamed /completion: token-id prompt, the request's adapter at scale 1 (others stay 0)."""

    def payload(request: BenchRequest) -> dict:
        return {"prompt": request.input_ids, "n_predict": request.output_len, "ignore_eos": True, "stream": True,
                "temperature": 0.0, "cache_prompt": False,
                "lora": [] if request.adapter is None else [{"id": adapter_ids[request.adapter], "scale": 1.0}]}

    # its HTTP server closes a connection idle for a few seconds: a new one per request
    return Wire("/completion", payload, lambda chunk: chunk.get("tokens_predicted", 0), keep_alive=False)


# ---- the weights in llama.cpp's format ----------------------------------------------------------------------------


def _run(cmd: list[str], cwd: Path) -> None:
    done = subprocess.run(cmd, cwd=cwd, env=dict(os.environ, PYTHONPATH=f"{cwd}{os.pathsep}{cwd / 'gguf-py'}"),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def convert_checkpoint(llama_cpp: Path, model_dir: Path, outfile: Path, outtype: str) -> None:
    """An HF checkpoint to one GGUF file (outtype: f32, f16, bf16, ...) through the tree's convert_hf_to_gguf.py."""
    _run([sys.executable, "-c", CONVERT, "convert_hf_to_gguf.py", str(model_dir), "--outtype", outtype,
          "--outfile", str(outfile)], llama_cpp)


def convert_adapter(llama_cpp: Path, adapter_dir: Path, base_dir: Path, outfile: Path, outtype: str) -> None:
    """A PEFT LoRA adapter to a GGUF LoRA through the tree's convert_lora_to_gguf.py (`base_dir`: its base's config)."""
    _run([sys.executable, "-c", CONVERT, "convert_lora_to_gguf.py", str(adapter_dir), "--base", str(base_dir),
          "--outtype", outtype, "--outfile", str(outfile)], llama_cpp)


def gguf_files(bench: BenchModel, llama_cpp: Path) -> tuple[dict[str, Path], dict[str, Path]]:
    """({GGUF type: base file}, {adapter name: file}), converted once into the bench model's gguf/ folder."""
    out = bench.base_dir.parent / "gguf"
    out.mkdir(exist_ok=True)
    bases = {kind: out / f"base-{kind.lower()}.gguf" for _, kind in PRECISIONS.values()}
    if not bases["BF16"].exists():
        print("converting the base to GGUF bf16", file=sys.stderr)
        convert_checkpoint(llama_cpp, bench.base_dir, bases["BF16"], "bf16")
    for kind, path in bases.items():
        if not path.exists():
            print(f"quantizing the base to {kind}", file=sys.stderr)
            _run([str(llama_cpp / "build" / "bin" / "llama-quantize"), str(bases["BF16"]), str(path), kind], llama_cpp)
    adapters = {}
    for name, adapter_dir in bench.adapter_dirs.items():
        adapters[name] = out / f"{name}.gguf"
        if not adapters[name].exists():
            print(f"converting adapter {name}", file=sys.stderr)
            convert_adapter(llama_cpp, adapter_dir, bench.base_dir, adapters[name], "bf16")
    return bases, adapters


# ---- llama-server -------------------------------------------------------------------------------------------------


class DiedAtStart(RuntimeError):
    """llama-server exited before it answered /health (on some CPUs its repacked Q8_0/Q4_0 kernels crash at load)."""


def llama_server_command(llama_cpp: Path, base: Path, adapters: list[Path], *, threads: int, slots: int, port: int,
                         no_repack: bool = False, extra: Sequence[str] = ()) -> list[str]:  # fmt: skip
    """The command line: the adapters as one comma-separated `--lora` list, as current llama.cpp reads it (a second
    `--lora` replaces the first there); `--no-repack` keeps the weights in their GGUF layout; `extra` goes last (a
    benchmark's own flags, e.g. speculative decoding's)."""
    commas = [str(path) for path in adapters if "," in str(path)]
    if commas:
        raise ValueError(f"llama-server's --lora list is comma-separated: rename {commas[0]}")
    lora = ["--lora", ",".join(str(path) for path in adapters), "--lora-init-without-apply"] if adapters else []
    return [str(llama_cpp / "build" / "bin" / "llama-server"), "-m", str(base), *lora,
            "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * CONTEXT_PER_SLOT),
            "--cont-batching", "--cache-ram", "0", *(["--no-repack"] if no_repack else []),
            "--host", "127.0.0.1", "--port", str(port), *extra]  # fmt: skip


def start_llama_server(llama_cpp: Path, base: Path, adapters: list[Path], *, threads: int, slots: int,
                       extra: Sequence[str] = ()) -> LlamaServer:  # fmt: skip
    """A healthy llama-server; one that dies at start is started again with --no-repack (`server.no_repack` says
    which ran, so the table can say so)."""
    try:
        return LlamaServer(llama_cpp, base, adapters, threads=threads, slots=slots, extra=extra)
    except DiedAtStart as e:
        print(f"{e}; retrying with --no-repack", file=sys.stderr)
        return LlamaServer(llama_cpp, base, adapters, threads=threads, slots=slots, no_repack=True, extra=extra)


class LlamaServer:
    """llama-server on one GGUF base with the adapters loaded unapplied, in its own session (stopped with it)."""

    def __init__(self, llama_cpp: Path, base: Path, adapters: list[Path], *, threads: int, slots: int,
                 no_repack: bool = False, extra: Sequence[str] = ()):  # fmt: skip
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.no_repack = no_repack
        cmd = llama_server_command(llama_cpp, base, adapters, threads=threads, slots=slots, port=port,
                                   no_repack=no_repack, extra=extra)  # fmt: skip
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-server-{port}.log"
        self.process = PeerProcess("llama-server", cmd, log_path)
        self.proc, self.log_path = self.process.proc, log_path
        try:
            self.process.wait_healthy(self.url, START_TIMEOUT_S, lambda code: DiedAtStart(
                f"llama-server{' --no-repack' * no_repack} exited at start ({code}); log: {log_path}"))
            # --lora-init-without-apply leaves each global scale at 1: zero them, requests name their own
            resp = requests.post(self.url + "/lora-adapters", json=[{"id": i, "scale": 0.0}
                                                                    for i in range(len(adapters))], timeout=30)
            resp.raise_for_status()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self.process.stop(term_wait_s=10)

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- the runs -----------------------------------------------------------------------------------------------------


def workloads(plan: Plan, adapter_names: list[str], seed: int) -> dict[str, tuple[list[BenchRequest], int]]:
    """name -> (requests, concurrency)."""
    single = make_workload(WorkloadSpec(num_requests=plan.single_requests, input_len_range=(64, 64),
                                        output_len_range=(plan.single_output, plan.single_output),
                                        adapter_names=tuple(adapter_names[:4]), seed=seed))
    single = [BenchRequest(r.index, r.input_ids, r.output_len, adapter_names[r.index % 4], 0.0) for r in single]
    mixed = make_workload(WorkloadSpec(num_requests=plan.num_requests, input_len_range=(16, 256),
                                       output_len_range=(16, 256), adapter_names=tuple(adapter_names), seed=seed))
    return {"single": (single, 1), "adapters": (mixed, plan.num_adapters)}


def drive(url: str, wire: Wire, runs: dict[str, tuple[list[BenchRequest], int]]) -> dict[str, dict]:
    """Warm-up (one short request per adapter), then each workload: {workload: summary}."""
    warm, concurrency = runs.get("adapters") or runs["single"]
    asyncio.run(warm_up(url, warm, concurrency, wire))
    return run_workloads(url, wire, runs)


def benchmark(bench: BenchModel, plan: Plan, llama_cpp: Path, *, rounds: int, threads: int, seed: int,
              only: Sequence[str] = WORKLOADS) -> dict:
    copies = bench_quantized.quantized_copies(bench)
    bases, adapter_files = gguf_files(bench, llama_cpp)
    names = list(bench.adapter_dirs)[: plan.num_adapters]
    runs = {name: run for name, run in workloads(plan, names, seed).items() if name in only}
    wire = llama_cpp_wire({name: i for i, name in enumerate(names)})
    raw: dict[str, dict[str, list[dict]]] = {p: {"loraplex": [], "llama.cpp": []} for p in PRECISIONS}
    no_repack = dict.fromkeys(PRECISIONS, False)  # llama-server died at start and ran with --no-repack
    for round_index in range(rounds):
        for index, (precision, (label, kind)) in enumerate(PRECISIONS.items()):
            order = ["loraplex", "llama.cpp"][:: 1 if (round_index + index) % 2 == 0 else -1]
            for side in order:
                print(f"round {round_index + 1}/{rounds}, {precision}: {side}", file=sys.stderr)
                if side == "loraplex":
                    with start_server(copies[label].base_dir, {n: bench.adapter_dirs[n] for n in names},
                                      dtype="bfloat16", server_threads=threads, max_running_requests=plan.num_adapters,
                                      max_loras_per_batch=plan.num_adapters) as server:
                        raw[precision][side].append(drive(server.url, LORAPLEX, runs))
                else:
                    with start_llama_server(llama_cpp, bases[kind], [adapter_files[n] for n in names],
                                            threads=threads, slots=plan.num_adapters) as server:  # fmt: skip
                        raw[precision][side].append(drive(server.url, wire, runs))
                        no_repack[precision] |= server.no_repack
    result = {"plan": plan.__dict__, "rounds": raw, "best": {}, "no_repack": no_repack}
    for precision, sides in raw.items():
        result["best"][precision] = {side: best_of(runs_) for side, runs_ in sides.items()}
    return result


def best_of(runs: list[dict]) -> dict:
    """One side's best figures over its rounds, for the workloads it ran."""
    best = {}
    if "single" in runs[0]:
        best["single_tok_s"] = max(1e3 / run["single"]["itl_ms"]["mean"] for run in runs)
    if "adapters" in runs[0]:
        best["adapters_tok_s"] = max(run["adapters"]["output_token_throughput"] for run in runs)
        best["adapters_ttft_p99_ms"] = min(run["adapters"]["ttft_ms"]["p99"] for run in runs)
    return best


def rows(result: dict) -> list[list[str]]:
    out = []
    for precision, sides in result["best"].items():
        ours, theirs = sides["loraplex"], sides["llama.cpp"]
        if result.get("no_repack", {}).get(precision):
            precision += " (llama-server --no-repack: it died at start without)"
        if "single_tok_s" in ours:
            out.append([f"{precision}: single-stream decode tok/s",
                        f"{ours['single_tok_s'] / theirs['single_tok_s']:.2f}",
                        f"{ours['single_tok_s']:.1f} vs {theirs['single_tok_s']:.1f}"])
        if "adapters_tok_s" not in ours:
            continue
        out.append([f"{precision}: {result['plan']['num_adapters']} adapters out tok/s",
                    f"{ours['adapters_tok_s'] / theirs['adapters_tok_s']:.2f}",
                    f"{ours['adapters_tok_s']:.1f} vs {theirs['adapters_tok_s']:.1f}; TTFT p99 "
                    f"{ours['adapters_ttft_p99_ms']:.0f} vs {theirs['adapters_ttft_p99_ms']:.0f} ms"])
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp source tree with build/bin built")
    parser.add_argument("--quick", action="store_true", help="few short requests on 4 adapters (a smoke run)")
    parser.add_argument("--rounds", type=int, default=2, help="each side runs each precision this many times")
    parser.add_argument("--threads", type=int, default=NUM_CORES, help="compute threads of each server")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: single, adapters")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every result here")
    args = parser.parse_args(argv)
    only = args.workloads.split(",")
    if not only or set(only) - set(WORKLOADS):
        parser.error(f"--workloads takes {', '.join(WORKLOADS)}")
    plan = QUICK if args.quick else FULL
    bench = ensure_bench_model(SIZES["full"], FULL.num_adapters)
    result = benchmark(bench, plan, args.llama_cpp.resolve(), rounds=args.rounds, threads=args.threads,
                       seed=args.seed, only=only)
    print(format_table(HEADERS, rows(result)))
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
