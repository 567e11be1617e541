"""Ahead-of-time compilation of the Triton LoRA kernels for a GPU architecture, on a machine without a GPU (Triton's
own ptxas): every kind of variant the server compiles at start-up (dtype, row tile, rank block, column alignment, the
float32 split-K planes of the serving path and the dtype h of the free functions), with what the PTX shows of the
memory access (16-byte vector loads, stores and async copies against 2-byte scalar loads).

    TRITON_INTERPRET=0 python -m kernels.aot --target sm_90 --target sm_80     # a table; --json for the records

The interpreter must be off (it replaces the kernels with Python functions that cannot be compiled)."""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from dataclasses import asdict, dataclass

TARGETS = {"sm_90": 90, "sm_80": 80}
WARP_SIZE = 32
POINTER_TYPES = {  # argument -> its element type; "dtype": the batch's, "h": the h planes'
    "x_ptr": "dtype", "a_ptr": "dtype", "y_ptr": "dtype", "b_ptr": "dtype", "h_ptr": "h",
    "seg_indptr_ptr": "i32", "seg_slots_ptr": "i32", "slot_ranks_ptr": "i32", "slice_offsets_ptr": "i32",
    "slot_scales_ptr": "fp32", "row_scales_ptr": "fp32",
}  # fmt: skip
# Integers that are multiples of 16 for real model and pool shapes (Triton specializes on it, as for 16-byte aligned
# pointers); the token-dependent ones are never specialized (do_not_specialize).
DIVISIBLE_INTS = {"in_dim", "stride_xm", "stride_a_slot", "stride_hm", "stride_ym", "stride_b_slot", "stride_b_rank"}
TYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class Variant:
    kernel: str  # "shrink" or "expand"
    dtype: str  # bfloat16, float16, float32
    block_m: int
    block_r: int
    h_dtype: str = "float32"  # expand: the split-K planes (serving) or the free function's h in the batch's dtype
    col_align: int = 8  # expand only
    seg_block: int = 64
    row_scales: bool = False  # expand only: each row's request strength (lora_scale) multiplied in


def variants() -> list[Variant]:
    out = []
    for dtype in TYPE_NAMES:
        out.append(Variant("shrink", dtype, 16, block_r=16))
        out.append(Variant("shrink", dtype, 64, block_r=64, seg_block=16))
        for col_align in (8, 1):
            out.append(Variant("expand", dtype, 64, block_r=16, col_align=col_align))
        out.append(Variant("expand", dtype, 64, block_r=16, row_scales=True))
        out.append(Variant("expand", dtype, 16, block_r=64, seg_block=16))
        if dtype != "float32":
            out.append(Variant("expand", dtype, 32, block_r=16, h_dtype=dtype))
        # An MoE layer's expert LoRA: rows in runs of one (expert, slot), so hundreds of segments in a decode step
        for kernel in ("shrink", "expand"):
            out.append(Variant(kernel, dtype, 16, block_r=16, seg_block=1024))
    return out


def compile_variant(arch: str, v: Variant) -> dict:
    import triton
    from loraplex.kernels.lora_expand import BLOCK_N, _expand_kernel
    from loraplex.kernels.lora_shrink import BLOCK_K, _shrink_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = _shrink_kernel if v.kernel == "shrink" else _expand_kernel
    constexprs = dict(BLOCK_M=v.block_m, BLOCK_R=v.block_r, SEG_BLOCK=v.seg_block,
                      DOT_PRECISION="ieee" if v.dtype == "float32" else "tf32")  # fmt: skip
    if v.kernel == "shrink":
        constexprs.update(BLOCK_K=BLOCK_K)
    else:
        constexprs.update(BLOCK_N=BLOCK_N, COL_ALIGN=v.col_align, HAS_ROW_SCALES=v.row_scales)
    element = {"dtype": TYPE_NAMES[v.dtype], "h": TYPE_NAMES[v.h_dtype]}
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in POINTER_TYPES:
            signature[name] = "*" + element.get(POINTER_TYPES[name], POINTER_TYPES[name])
        else:
            signature[name] = "i32"
    divisible = [n for n in kernel.arg_names if n in POINTER_TYPES or n in DIVISIBLE_INTS]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    start = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", TARGETS[arch], WARP_SIZE))  # fmt: skip
    except Exception as e:  # a compile error is the result, reported per variant
        return dict(arch=arch, **asdict(v), ok=False, error=f"{type(e).__name__}: {e}"[:500])
    ptx = compiled.asm["ptx"]
    return dict(
        arch=arch, **asdict(v), ok=True, seconds=round(time.perf_counter() - start, 2),
        vector_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.v4", ptx)),
        vector_stores=len(re.findall(r"st\.global(?:\.\w+)*\.v4", ptx)),
        scalar_16bit_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.b16", ptx)),
        async_copies=len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)),  # 16 bytes each, into shared memory
        cubin_bytes=len(compiled.asm["cubin"]),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="default: all")
    parser.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("TRITON_INTERPRET is set: the interpreter's kernels cannot be compiled (run with it at 0)")
    results = [compile_variant(arch, v) for arch in (args.target or sorted(TARGETS)) for v in variants()]
    if args.json:
        print(json.dumps(results))
    else:
        for r in results:
            status = r["error"] if not r["ok"] else (
                f"{r['seconds']:5.2f} s, 16-byte loads/stores/async copies {r['vector_loads']}/{r['vector_stores']}/"
                f"{r['async_copies']}, 2-byte loads {r['scalar_16bit_loads']}"
            )  # fmt: skip
            print(f"{r['arch']} {r['kernel']:6} {r['dtype']:8} BM{r['block_m']:<2} BR{r['block_r']:<2} "
                  f"h {r['h_dtype']:8} align {r['col_align']}: {status}")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
