"""The groups of the GPU check (runner.py), their caps, and the plan: the exact device commands and their expected time.

Plain Python (the parent never imports torch). A session has SESSION_DEVICE_S of device time, a fresh machine's start
included, and one call is at most DEVICE_CALL_S, with a cold cache (every Triton variant compiles on first use). So the
default plan is two calls, the correctness groups first and then the speed and serving groups, each with its install
and an import warm-up, each ending inside its call even with every group at its cap (CALL_LIMIT_S), and the two
expected to leave room for a rerun of either. Caps are warm-cache caps times one scale, COLD_CAP_SCALE by default.
`--plan` prints that arithmetic; tests/integrations/test_gpu_check.py asserts it.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

DEVICE_CALL_S = 600  # the device tool's limit for one command
CALL_LIMIT_S = 560  # a call at its worst (install, warm-up, every group at its cap): a margin under DEVICE_CALL_S
SESSION_DEVICE_S = 900  # a session's device time: the machine's start and every call, a rerun included
MACHINE_START_S = 180  # a fresh machine's start ("a few minutes"), counted against the session
INSTALL_S = 40  # pip install of the wheels and this tree into /tmp/site (no network, no compile)
WARM_IMPORTS_S = 120  # the warm-up's own timeout: a cold first `import torch, triton, transformers` reads GBs from disk
WARM_IMPORTS_ESTIMATE_S = (25, 5)  # expected: on a fresh machine; on the same machine again (the files page-cached)
PARENT_OVERHEAD_S = 3  # a group's spawn, kill and merge, beyond its cap
COLD_CAP_SCALE = 1.4  # cold Triton cache: every kernel variant compiles once (~0.3-1 s each)
SANITIZER = "g8"
SANITIZER_S = 240  # G8's own budget when --sanitizer asks for it: memcheck slows kernels 10-100x
# What the GPU image has (GPU_CHECK.md): gpu_wheels.txt brings the rest, each wheel's dependencies included.
IMAGE_PACKAGES = ("torch", "triton", "transformers", "peft", "tokenizers", "safetensors", "aiohttp", "uvloop", "psutil",
                  "prometheus-client", "numpy")
# The default plan's calls: (what they check, --only). G0 opens both (versions, and the ceilings the later groups
# compare against); G4, G5 and G5b share one call (G5 serves G4's model; G5b compares with G5's tokens).
CALLS = (("correctness", "g0,g1,g2,g3,g9,g7"), ("speed and serving", "g0,g4,g5,g5b,g6"))


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
    Group("g0", "env", 20, 45, "scripts.gpu_check.model", "g0_env", 10),
    Group("g1", "kernels", 50, 120, "scripts.gpu_check.kernels", "g1_kernels", 45),  # LoRA, then Gated DeltaNet
    Group("g2", "attention", 34, 120, "scripts.gpu_check.model", "g2_attention", 30),  # plain, then latent
    Group("g3", "numerics", 33, 90, "scripts.gpu_check.model", "g3_numerics", 30),
    Group("g4", "decode", 60, 120, "scripts.gpu_check.serving", "g4_decode", 55),
    Group("g5", "server", 55, 120, "scripts.gpu_check.serving", "g5_server", 50),
    Group("g5b", "server_graphs", 45, 120, "scripts.gpu_check.serving", "g5b_server_graphs", 40),
    Group("g6", "kernel_perf", 20, 90, "scripts.gpu_check.kernels", "g6_kernel_perf", 15),
    Group("g9", "quantized", 16, 90, "scripts.gpu_check.quant", "g9_quantized", 12),
    Group("g7", "tp2", 40, 90, "scripts.gpu_check.tp", "g7_tp2", 35),
    # off by default: under memcheck the small kernels alone take minutes; --sanitizer gives it SANITIZER_S
    Group(SANITIZER, "sanitizer", SANITIZER_S, 30, "scripts.gpu_check.tp", "g8_sanitizer", 180, in_default_run=False),
    Group("kernels_small", "kernels_small", 20, 120, "scripts.gpu_check.kernels", "kernels_small", 15,
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


def call_timeout_s(args: argparse.Namespace) -> int:
    """The `timeout` of the check's own command: its groups' caps and the parent's overhead."""
    return int(caps_total(args) + PARENT_OVERHEAD_S * len(selected_groups(args)) + 15)


def device_command(args: argparse.Namespace) -> str:
    """The one line to run on the GPU machine from the repository root, `.whl/` brought along (GPU_CHECK.md): the
    install, the import warm-up (its own timeout, outside the groups' caps), then the check."""
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
        f"timeout {WARM_IMPORTS_S} python3 -m scripts.gpu_check --warm-imports 2>&1 | tee $OUT/gpu_check.log; "
        f"timeout -k 10 {call_timeout_s(args)} python3 -m scripts.gpu_check --out $OUT {' '.join(options)} 2>&1 "
        "| tee -a $OUT/gpu_check.log"
    )


@dataclass(frozen=True)
class CallPlan:
    title: str
    args: argparse.Namespace
    groups: list[Group]
    caps_s: float
    expected_s: float  # install + warm-up + the groups' cold estimates
    worst_s: float  # install + warm-up at its timeout + the check at its timeout + the kill's grace

    @classmethod
    def of(cls, title: str, args: argparse.Namespace, is_first: bool = True) -> CallPlan:
        groups = selected_groups(args)
        overhead = PARENT_OVERHEAD_S * len(groups)
        warm_up = WARM_IMPORTS_ESTIMATE_S[0 if is_first else 1]
        expected = INSTALL_S + warm_up + sum(g.estimate_s for g in groups) + overhead
        worst = INSTALL_S + WARM_IMPORTS_S + call_timeout_s(args) + 10
        return cls(title, args, groups, caps_total(args), expected, worst)


def planned_calls(args: argparse.Namespace) -> list[CallPlan]:
    """The calls to run: the two of CALLS (and G8 on its own with --sanitizer), or with --only / --skip the one call
    for that selection (a rerun)."""
    if args.only or args.skip:
        return [CallPlan.of("selected groups", args)]
    calls = [CallPlan.of(title, argparse.Namespace(**{**vars(args), "only": only, "sanitizer": False}), i == 0)
             for i, (title, only) in enumerate(CALLS)]  # fmt: skip
    if args.sanitizer:
        calls.append(CallPlan.of("sanitizer", argparse.Namespace(**{**vars(args), "only": SANITIZER}), False))
    return calls


def plan_lines(args: argparse.Namespace) -> list[str]:
    calls = planned_calls(args)
    lines = []
    for i, call in enumerate(calls, 1):
        lines += [f"call {i} of {len(calls)}, {call.title}: {' '.join(g.gid for g in call.groups)}",
                  "  groups (cap s at this scale / cold estimate s):"]  # fmt: skip
        lines += [f"    {g.gid:<4} {g.name:<14} {cap_of(g, call.args):6.0f} / {g.estimate_s:4.0f}" for g in call.groups]
        lines += [
            f"  caps summed: {call.caps_s:.0f} s (--cap-scale {args.cap_scale:g}); expected: {call.expected_s:.0f} s "
            f"(install {INSTALL_S} s + warm-up + the groups' cold estimates); at worst "
            f"{call.worst_s:.0f} s (limit {CALL_LIMIT_S} s) of one {DEVICE_CALL_S} s device call",
            f"  device command (one line; timeout_s {DEVICE_CALL_S}):",
            device_command(call.args),
        ]
    expected = MACHINE_START_S + sum(call.expected_s for call in calls)
    lines.append(
        f"session: machine start ~{MACHINE_START_S} s + "
        + " + ".join(f"call {i} ~{call.expected_s:.0f} s" for i, call in enumerate(calls, 1))
        + f" = ~{expected:.0f} s of {SESSION_DEVICE_S} s device time; left for a rerun: "
        f"~{SESSION_DEVICE_S - expected:.0f} s (the longest call, cold: ~{max(c.expected_s for c in calls):.0f} s; "
        "warm, --cap-scale 1, less)"
    )
    return lines


def print_plan(args: argparse.Namespace) -> None:
    print("\n".join(plan_lines(args)), flush=True)


def triton_cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def triton_cache_entries() -> int:
    """Compiled kernels in Triton's on-disk cache (one directory each): 0 on a cold machine."""
    cache = triton_cache_dir()
    return sum(1 for entry in cache.iterdir() if entry.is_dir()) if cache.is_dir() else 0
