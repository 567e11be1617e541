"""The groups of scripts/gpu_check.py, their caps, and the plan: the exact device command and its expected time.

Plain Python (the parent never imports torch). One device call is at most 10 minutes and the cache is cold (every
Triton variant compiles on first use), so the caps are warm-cache caps times one scale, COLD_CAP_SCALE by default,
and the default run's caps sum to at most CAPS_LIMIT_S: with the install and the parent's overhead the command's own
`timeout` still ends inside the call. `--plan` prints that arithmetic; tests/integrations/test_gpu_check.py asserts it.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

DEVICE_CALL_S = 600  # the device tool's limit for one command
CAPS_LIMIT_S = 480  # the default run's caps, summed, at the default scale
INSTALL_S = 40  # pip install of the wheels and this tree into /tmp/site (no network, no compile)
PARENT_OVERHEAD_S = 3  # a group's spawn, kill and merge, beyond its cap
COLD_CAP_SCALE = 1.4  # cold Triton cache: every kernel variant compiles once (~0.3-1 s each)
SANITIZER = "g8"
SANITIZER_S = 240  # G8's own budget when --sanitizer asks for it: memcheck slows kernels 10-100x
# What the GPU image has (GPU_CHECK.md): scripts/gpu_wheels.txt brings the rest, each wheel's dependencies included.
IMAGE_PACKAGES = ("torch", "triton", "transformers", "peft", "tokenizers", "safetensors", "aiohttp", "uvloop", "psutil",
                  "prometheus-client", "numpy")


@dataclass(frozen=True)
class Group:
    gid: str
    name: str
    cap_s: float  # hard per-group limit on a GPU with a warm Triton cache; the run scales it by --cap-scale
    dry_cap_s: float  # on a CPU dry run (2 slow shared cores; torch import alone takes seconds)
    module: str
    func: str
    estimate_s: float  # expected wall on a GPU with a cold cache (the plan's estimate)
    in_default_run: bool = True


GROUPS = [
    Group("g0", "env", 10, 45, "scripts.gpu_check_model", "g0_env", 8),
    Group("g1", "kernels", 40, 90, "scripts.gpu_check_kernels", "g1_kernels", 35),
    Group("g2", "attention", 25, 90, "scripts.gpu_check_model", "g2_attention", 20),
    Group("g3", "numerics", 33, 90, "scripts.gpu_check_model", "g3_numerics", 30),
    Group("g4", "decode", 60, 120, "scripts.gpu_check_serving", "g4_decode", 55),
    Group("g5", "server", 55, 120, "scripts.gpu_check_serving", "g5_server", 50),
    Group("g5b", "server_graphs", 45, 120, "scripts.gpu_check_serving", "g5b_server_graphs", 40),
    Group("g6", "kernel_perf", 20, 90, "scripts.gpu_check_kernels", "g6_kernel_perf", 15),
    Group("g9", "quantized", 14, 90, "scripts.gpu_check_quant", "g9_quantized", 12),
    Group("g7", "tp2", 40, 90, "scripts.gpu_check_tp", "g7_tp2", 35),
    # off by default: under memcheck the small kernels alone take minutes; --sanitizer gives it SANITIZER_S
    Group(SANITIZER, "sanitizer", SANITIZER_S, 30, "scripts.gpu_check_tp", "g8_sanitizer", 180, in_default_run=False),
    Group("kernels_small", "kernels_small", 20, 60, "scripts.gpu_check_kernels", "kernels_small", 15,
          in_default_run=False),
]


def _names(text: str) -> set[str]:
    return {part.strip() for part in text.split(",") if part.strip()}


def selected_groups(args: argparse.Namespace) -> list[Group]:
    only, skip = _names(args.only), _names(args.skip)
    known = {g.gid for g in GROUPS} | {g.name for g in GROUPS}
    unknown = (only | skip) - known
    if unknown:
        raise SystemExit(f"unknown group(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    if only:
        chosen = [g for g in GROUPS if g.gid in only or g.name in only]
    else:
        chosen = [g for g in GROUPS if g.in_default_run or (g.gid == SANITIZER and args.sanitizer)]
    return [g for g in chosen if g.gid not in skip and g.name not in skip]


def cap_of(group: Group, args: argparse.Namespace) -> float:
    if args.dry_run:
        return group.dry_cap_s
    if group.gid == SANITIZER:  # its own budget, not scaled
        return float(args.sanitizer_s)
    return group.cap_s * args.cap_scale


def caps_total(args: argparse.Namespace) -> float:
    return sum(cap_of(g, args) for g in selected_groups(args))


def device_command(args: argparse.Namespace) -> str:
    """The one line to run on the GPU machine from the repository root, `.whl/` brought along (GPU_CHECK.md)."""
    groups = selected_groups(args)
    timeout_s = int(caps_total(args) + PARENT_OVERHEAD_S * len(groups) + 15)
    options = [f"--cap-scale {args.cap_scale:g}"]
    if args.only:
        options.append(f"--only {args.only}")
    if args.skip:
        options.append(f"--skip {args.skip}")
    if args.sanitizer:
        options.append(f"--sanitizer --sanitizer-s {args.sanitizer_s:g}")
    return (
        "set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile "
        "--no-cache-dir --upgrade --target /tmp/site .whl/*.whl . || exit 3; export PYTHONPATH=/tmp/site:$PWD "
        "PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false; "
        f"timeout -k 10 {timeout_s} python3 -m scripts.gpu_check --out $OUT {' '.join(options)} 2>&1 "
        "| tee $OUT/gpu_check.log"
    )


def plan_lines(args: argparse.Namespace) -> list[str]:
    groups = selected_groups(args)
    caps = caps_total(args)
    worst = INSTALL_S + caps + PARENT_OVERHEAD_S * len(groups) + 15 + 10
    expected = INSTALL_S + sum(g.estimate_s for g in groups) + PARENT_OVERHEAD_S * len(groups)
    lines = ["groups (cap s at this scale / cold estimate s):"]
    lines += [f"  {g.gid:<4} {g.name:<14} {cap_of(g, args):6.0f} / {g.estimate_s:4.0f}" for g in groups]
    lines += [
        f"caps summed: {caps:.0f} s (limit {CAPS_LIMIT_S} s at the default --cap-scale {COLD_CAP_SCALE:g}; "
        f"this run --cap-scale {args.cap_scale:g})",
        f"expected: {expected:.0f} s (install {INSTALL_S} s + the groups' cold estimates); at worst "
        f"{worst:.0f} s (every group at its cap) of one {DEVICE_CALL_S} s device call",
        "device command (one line; timeout_s 600):",
        device_command(args),
    ]
    return lines


def print_plan(args: argparse.Namespace) -> None:
    print("\n".join(plan_lines(args)), flush=True)


def triton_cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def triton_cache_entries() -> int:
    """Compiled kernels in Triton's on-disk cache (one directory each): 0 on a cold machine."""
    cache = triton_cache_dir()
    return sum(1 for entry in cache.iterdir() if entry.is_dir()) if cache.is_dir() else 0
