"""The one GPU check: correctness, numerics and performance of the CUDA path, in under 5 minutes on one H200.

    python -m scripts.gpu_check --out DIR [--budget-s 285] [--only g1,g2] [--skip g5] [--dry-run] [--keep-models DIR]

The specification (groups, shapes, thresholds, report) and the command that runs it on a GPU: scripts/GPU_CHECK.md,
beside this file. Groups G0-G8 each run in a fresh spawned child under a hard cap, so a CUDA fault or a hang in one
cannot poison or stall the rest; this parent never imports torch. Each child writes DIR/part_<group>.json (after every
check); the parent merges them into DIR/gpu_check.json after every group, prints one line per check as it goes and the
reviewer block at the end. `--dry-run` runs everything on the CPU at tiny shapes (Triton in its
interpreter; what needs CUDA is skipped with a reason), to find Python bugs before GPU minutes are spent.

Counts in the summary: pass/fail are checks (kind "check"); error counts groups that raised or timed out; skipped
counts skipped checks and skipped groups. Flags (kind "flag") never fail the run; raised ones are in perf_flags.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.gpu_check_lib import REPO_ROOT, format_check, run_group
from scripts.gpu_check_report import reviewer_block, summarize


@dataclass(frozen=True)
class Group:
    gid: str
    name: str
    cap_s: float  # hard per-group limit on the GPU
    dry_cap_s: float  # on a CPU dry run (2 slow shared cores; torch import alone takes seconds)
    module: str
    func: str
    in_default_run: bool = True


GROUPS = [
    Group("g0", "env", 8, 45, "scripts.gpu_check_model", "g0_env"),
    Group("g1", "kernels", 35, 90, "scripts.gpu_check_kernels", "g1_kernels"),
    Group("g2", "attention", 20, 90, "scripts.gpu_check_model", "g2_attention"),
    Group("g3", "numerics", 30, 90, "scripts.gpu_check_model", "g3_numerics"),
    Group("g4", "decode", 45, 90, "scripts.gpu_check_serving", "g4_decode"),
    Group("g5", "server", 75, 120, "scripts.gpu_check_serving", "g5_server"),
    Group("g6", "kernel_perf", 20, 45, "scripts.gpu_check_kernels", "g6_kernel_perf"),
    Group("g7", "tp2", 40, 90, "scripts.gpu_check_tp", "g7_tp2"),
    Group("g8", "sanitizer", 20, 30, "scripts.gpu_check_tp", "g8_sanitizer"),
    Group("kernels_small", "kernels_small", 20, 60, "scripts.gpu_check_kernels", "kernels_small", in_default_run=False),
]
SANITIZER = "g8"  # gets what is left, at most its cap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for gpu_check.json and part_<group>.json")
    parser.add_argument("--budget-s", type=float, default=None, help="whole-run budget (default 285; 600 dry)")
    parser.add_argument("--only", default="", help="comma-separated groups (g1 or kernels) to run")
    parser.add_argument("--skip", default="", help="comma-separated groups to leave out")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes; CUDA-only parts skip")
    parser.add_argument("--keep-models", default=None, metavar="DIR",
                        help="where G4 writes the 1B model and adapters (G5 reuses them); default a temporary dir")
    args = parser.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = 600.0 if args.dry_run else 285.0
    return args


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
        chosen = [g for g in GROUPS if g.in_default_run]
    return [g for g in chosen if g.gid not in skip and g.name not in skip]


def run_child(group: Group, args: argparse.Namespace, cap_s: float, ceilings: dict, keep_models: str) -> dict:
    """Run one group in a spawned child; its part file, or an error/timeout entry when it left none."""
    out_dir = Path(args.out)
    part_path = out_dir / f"part_{group.gid}.json"
    part_path.unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=run_group, name=f"gpu_check-{group.gid}",
                       args=(group.gid, group.module, group.func, str(out_dir), args.dry_run, keep_models, ceilings))
    start = time.monotonic()
    proc.start()
    proc.join(cap_s)
    timed_out = proc.is_alive()
    if timed_out:
        proc.kill()
        proc.join(10)
    wall_s = time.monotonic() - start
    part = json.loads(part_path.read_text()) if part_path.exists() else {
        "status": "error", "reason": None, "checks": [], "figures": {}, "error_tail": None}
    if timed_out:
        part.update(status="timeout", reason=f"killed at its cap of {cap_s:.0f} s")
    elif part["status"] == "running":  # died without finishing (a fault, os._exit)
        part.update(status="error", reason=f"child exited with code {proc.exitcode}")
    part["wall_s"] = round(wall_s, 2)
    part.setdefault("reason", None)
    return part


def git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def write_report(out_dir: Path, report: dict) -> None:
    report["summary"] = summarize(report["groups"])
    tmp = out_dir / "gpu_check.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out_dir / "gpu_check.json")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.dry_run:  # before any child imports triton: the kernels run in the interpreter (runners: torch backend)
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Not under --out: a run killed from outside must not ship gigabytes of weights back with the report.
    keep_models = args.keep_models or tempfile.mkdtemp(prefix="gpu_check_models_")
    started = time.monotonic()
    report: dict = {
        "meta": {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "wall_s": 0.0, "budget_s": args.budget_s, "dry_run": args.dry_run, "git": git_sha(),
                 "versions": {}, "device": {}, "ceilings": {},
                 "env": {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES",
                                                        "PYTHONPATH")}},
        "groups": {},
    }
    for group in selected_groups(args):
        left_s = args.budget_s - (time.monotonic() - started)
        cap_s = group.dry_cap_s if args.dry_run else group.cap_s
        if group.gid == SANITIZER:
            cap_s = min(cap_s, max(0.0, left_s))
        print(f"=== {group.gid} {group.name} (cap {cap_s:.0f} s, {left_s:.0f} s left)", flush=True)
        if left_s < cap_s or cap_s <= 0:
            part = {"status": "skipped", "wall_s": 0.0, "reason": "budget", "checks": [], "figures": {},
                    "error_tail": None}
        else:
            part = run_child(group, args, cap_s, report["meta"]["ceilings"], keep_models)
        report["groups"][group.gid] = part
        if group.gid == "g0":
            figures = part.get("figures", {})
            for key in ("versions", "device", "ceilings"):
                report["meta"][key] = figures.get(key, {})
        print(f"--- {group.gid} {group.name}: {part['status'].upper()} in {part['wall_s']:.1f} s"
              + (f" ({part['reason']})" if part.get("reason") else ""), flush=True)
        if part["status"] in ("error", "timeout") and part.get("error_tail"):
            print(part["error_tail"][-1500:], flush=True)
        report["meta"]["wall_s"] = round(time.monotonic() - started, 1)
        write_report(out_dir, report)
    if not args.keep_models:
        import shutil

        shutil.rmtree(keep_models, ignore_errors=True)
    report["meta"]["wall_s"] = round(time.monotonic() - started, 1)
    write_report(out_dir, report)
    failed = [f"{gid}.{c['name']}" for gid, g in report["groups"].items() for c in g["checks"]
              if c["kind"] == "check" and c["pass"] is False]
    if failed:
        print("failed checks:", flush=True)
        for gid, g in report["groups"].items():
            for c in g["checks"]:
                if c["kind"] == "check" and c["pass"] is False:
                    print(f"  [{gid}] {format_check(c)}", flush=True)
    print(reviewer_block(report), flush=True)
    return report


if __name__ == "__main__":
    report = main()
    summary = report["summary"]
    sys.exit(1 if summary["fail"] or summary["error"] else 0)
