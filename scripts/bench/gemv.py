"""Per-linear timings: the CPU linears' kernels (kernels/cpu_gemv.py: the AVX-512 BF16 build where the CPU has it, else
the AVX2 one) against the torch path the worker takes with LORAPLEX_CPU_GEMV=off, at bf16, INT8 (per channel) and INT4
(groups of 128), 1 and 32 rows (or --rows), on a decode step's shapes, each weight called again and again (hot in
cache: the kernels' arithmetic, not the memory's speed; scripts.bench.roofline measures the step from memory).

torch's paths: bf16 `F.linear` on the oneDNN-packed weight where oneDNN has bf16 (packed.py), else the plain one;
INT8 torch._weight_int8pack_mm, INT4 torch._weight_int4pack_mm_for_cpu (worker/quant/matmul.py). Both paths alternate
in rounds so that both see the same machine; prints the fastest call (the median of the rounds' fastest), the weight
bytes the kernel reads per second, and the ratio.

    python -m scripts.bench.gemv                     # 2048 x 2048 and 2 x 5632 x 2048 (gate|up fused), 2 threads
    python -m scripts.bench.gemv --shapes 4096x4096 --threads 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from loraplex.kernels import cpu_gemv
from loraplex.worker.layers import packed
from loraplex.worker.quant.avx2 import Avx2IntMatmul
from loraplex.worker.quant.matmul import Int4GroupMatmul, Int8ChannelMatmul
from loraplex.worker.quant.weights import IntWeight


def min_ms(fn, x: torch.Tensor, repeats: int) -> float:
    """The fastest of `repeats` calls: on a shared machine the others measure its other tenants."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def paths(precision: str, out_features: int, in_features: int):
    """(kernel, torch path, weight bytes the kernel reads, activation dtype)."""
    gen = torch.Generator().manual_seed(0)
    if precision == "bf16":
        w = (0.02 * torch.randn(out_features, in_features, generator=gen)).bfloat16()
        plain = packed.unavailable_reason(torch.device("cpu"), torch.bfloat16) is not None
        packed_w = None if plain else torch.ops.mkldnn._reorder_linear_weight(w, None)
        ours = cpu_gemv.pack_bf16(w)
        return (lambda x: cpu_gemv.gemv(x, ours),
                lambda x: packed.linear(x, w, packed_w), ours.nbytes, torch.bfloat16)
    bits, group = (8, in_features) if precision == "int8" else (4, 128)
    weight = IntWeight.random(out_features, in_features, bits=bits, group_size=group, zero_point=1 << (bits - 1),
                              std=0.02, generator=gen)
    ours = Avx2IntMatmul(weight, torch.bfloat16)
    ref = (Int8ChannelMatmul if bits == 8 else Int4GroupMatmul)(weight, torch.bfloat16)
    return ours, ref, ours.nbytes, torch.bfloat16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["2048x2048", "11264x2048"], help="OUTxIN per linear")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_gemv.kernels() is None:
        raise SystemExit(f"the skinny-matrix kernels cannot run here: {cpu_gemv.unavailable_reason()}")
    print(f"kernels: the {cpu_gemv.isa().name} build, {args.threads} thread(s)")
    rows_out = []
    print(f"{'precision':9} {'shape':>11} {'rows':>4} {'kernel ms':>9} {'torch ms':>9} {'GB/s':>6} {'speedup':>7}")
    for shape in args.shapes:
        out_features, in_features = map(int, shape.split("x"))
        for precision in ("bf16", "int8", "int4"):
            ours, ref, nbytes, dtype = paths(precision, out_features, in_features)
            for rows in args.rows:
                x = torch.randn(rows, in_features).to(dtype)
                ours(x), ref(x)  # warm
                ours_all, ref_all = [], []
                for _ in range(5):  # alternate in rounds: the machine's speed drifts
                    ours_all.append(min_ms(ours, x, args.repeats // 5 or 1))
                    ref_all.append(min_ms(ref, x, args.repeats // 5 or 1))
                ours_ms, ref_ms = statistics.median(ours_all), statistics.median(ref_all)
                row = dict(precision=precision, shape=shape, rows=rows, kernel_ms=round(ours_ms, 4),
                           torch_ms=round(ref_ms, 4), kernel_gbs=round(nbytes / ours_ms / 1e6, 2),
                           speedup=round(ref_ms / ours_ms, 2), threads=args.threads, build=cpu_gemv.isa().name)
                rows_out.append(row)
                print(f"{precision:9} {shape:>11} {rows:>4} {ours_ms:9.3f} {ref_ms:9.3f} {row['kernel_gbs']:6.1f} "
                      f"{row['speedup']:6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
