"""The one GPU check: correctness, numerics and performance of the CUDA path, in two cold device calls (--plan).

    python -m scripts.gpu_check --out DIR [--cap-scale 1.4] [--only g1,g2] [--skip g5] [--sanitizer] [--dry-run]
    python -m scripts.gpu_check --plan      # the exact device commands and their expected time; runs nothing
    python -m scripts.gpu_check --warm-imports  # the device command's first step: cold imports before any cap runs

The specification (groups, shapes, thresholds, report) and the command that runs it on a GPU: GPU_CHECK.md, beside
this file; the groups, caps and plan: plan.py. Each group runs in a fresh spawned child
under a hard cap (a warm-cache cap times --cap-scale), so a CUDA fault or a hang in one cannot poison or stall the
rest; this parent never imports torch. A child leads its own process group and registers the servers it starts in
sessions of their own; when the group ends or reaches its cap the parent kills all of them, so nothing holds GPU memory
into the next group. A child writes its part file to a scratch directory after every check and figure; the parent
folds it into DIR/gpu_check.json every few seconds while the group runs, so a run killed from outside still returns
what was measured. DIR receives only gpu_check.json, env.txt and server_tail.log (plus the log the device command
tees). `--dry-run` runs everything on the CPU at tiny shapes (Triton in its interpreter; what needs CUDA is skipped
with a reason), to find Python bugs before GPU minutes are spent.

Counts in the summary: pass/fail are checks (kind "check"); error counts groups that raised or timed out; skipped
counts skipped checks and skipped groups. Flags (kind "flag") never fail the run; raised ones are in perf_flags.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from scripts.gpu_check.lib import REPO_ROOT, format_check, run_group
from scripts.gpu_check.plan import (
    COLD_CAP_SCALE,
    SANITIZER_S,
    Group,
    cap_of,
    caps_total,
    print_plan,
    selected_groups,
    triton_cache_entries,
)
from scripts.gpu_check.report import reviewer_block, summarize

MERGE_EVERY_S = 2.0  # how often the parent folds a running group's part file into gpu_check.json


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="directory for gpu_check.json, env.txt and server_tail.log")
    parser.add_argument("--cap-scale", type=float, default=COLD_CAP_SCALE,
                        help=f"multiplies every group's warm-cache cap (default {COLD_CAP_SCALE:g}: a cold cache)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="whole-run budget (default: the selected groups' caps summed)")
    parser.add_argument("--only", default="", help="comma-separated groups (g1 or kernels) to run")
    parser.add_argument("--skip", default="", help="comma-separated groups to leave out")
    parser.add_argument("--sanitizer", action="store_true", help="also run G8 (compute-sanitizer), off by default")
    parser.add_argument("--sanitizer-s", type=float, default=SANITIZER_S, help="G8's own budget in seconds")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes; CUDA-only parts skip")
    parser.add_argument("--plan", action="store_true", help="print the device commands and expected time; run nothing")
    parser.add_argument("--warm-imports", action="store_true",
                        help="import torch, triton, transformers and xgrammar once (a fresh machine reads them cold)")
    parser.add_argument("--keep-models", default=None, metavar="DIR",
                        help="where G4 writes the 1B model and adapters (G5 reuses them); default a temporary dir")
    args = parser.parse_args(argv)
    if not (args.plan or args.warm_imports) and not args.out:
        parser.error("--out is required (except with --plan or --warm-imports)")
    if args.budget_s is None:
        args.budget_s = caps_total(args) + 5
    return args


def _kill_group_processes(group: Group, pid: int, work_dir: Path) -> None:
    """The child's own process group (its TP ranks, compute-sanitizer) and every server session it registered."""
    pgids = [pid]
    registry = work_dir / f"pgids_{group.gid}.txt"
    if registry.exists():
        pgids += [int(line) for line in registry.read_text().split()]
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _read_part(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not there yet, or replaced mid-read
        return None


def run_child(group: Group, args: argparse.Namespace, cap_s: float, report: dict, keep_models: str,
              work_dir: Path) -> dict:
    """Run one group in a spawned child; its part file, or an error/timeout entry when it left none. While it runs,
    its part is folded into the report every MERGE_EVERY_S, so figures reach gpu_check.json as they are measured."""
    out_dir = Path(args.out)
    part_path = work_dir / f"part_{group.gid}.json"
    part_path.unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=run_group, name=f"gpu_check-{group.gid}",
                       args=(group.gid, group.module, group.func, str(out_dir), str(work_dir), args.dry_run,
                             keep_models, report["meta"]["ceilings"], cap_s))
    start = time.monotonic()
    proc.start()
    while proc.is_alive() and time.monotonic() - start < cap_s:
        proc.join(min(MERGE_EVERY_S, max(0.0, cap_s - (time.monotonic() - start))))
        running = _read_part(part_path)
        if running is not None and proc.is_alive():
            report["groups"][group.gid] = running
            write_report(out_dir, report)
    timed_out = proc.is_alive()
    _kill_group_processes(group, proc.pid, work_dir)  # at the cap, and stragglers after a normal end
    proc.join(10)
    wall_s = time.monotonic() - start
    part = _read_part(part_path) or {"status": "error", "reason": None, "checks": [], "figures": {},
                                     "error_tail": None}
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


def write_env(out_dir: Path, report: dict) -> None:
    """env.txt: the versions G0 read and nvidia-smi's own report (driver, CUDA, memory, other processes)."""
    meta = report["meta"]
    lines = [f"{k}: {v}" for k, v in meta.get("versions", {}).items()]
    lines += [f"device.{k}: {v}" for k, v in meta.get("device", {}).items()]
    lines += [f"triton_cache_entries: {meta.get('triton_cache', {})}", f"git: {meta.get('git')}", ""]
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as e:
        smi = f"nvidia-smi: {e}"
    (out_dir / "env.txt").write_text("\n".join(lines) + "\n" + smi)


def warm_imports() -> None:
    """A fresh machine's first `import torch, triton, transformers` reads gigabytes from a cold disk (tens of seconds):
    done here, before the groups' caps run, it leaves G0 and every child the page-cached import. In a process of its
    own: the parent never imports torch. xgrammar's import is warmed too; G0 reports whether it works."""
    start = time.monotonic()
    for module in ("torch", "triton", "transformers", "xgrammar"):
        began = time.monotonic()
        try:
            __import__(module)
            outcome = "ok"
        except Exception as e:  # noqa: BLE001 - reported, not raised: G0 checks the imports
            outcome = f"{type(e).__name__}: {e}"
        print(f"warm-up: import {module} {time.monotonic() - began:.1f} s ({outcome})", flush=True)
    print(f"warm-up: imports in {time.monotonic() - start:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.plan:
        print_plan(args)
        return None
    if args.warm_imports:
        warm_imports()
        return None
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.dry_run:  # before any child imports triton: the kernels run in the interpreter (runners: torch backend)
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Not under --out: part files, server logs and the models never travel back with the report.
    work_dir = Path(tempfile.mkdtemp(prefix="gpu_check_run_"))
    keep_models = args.keep_models or str(work_dir / "models")
    started = time.monotonic()
    report: dict = {
        "meta": {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "wall_s": 0.0, "budget_s": args.budget_s, "cap_scale": args.cap_scale, "dry_run": args.dry_run,
                 "git": git_sha(), "versions": {}, "device": {}, "ceilings": {},
                 "triton_cache": {"before": triton_cache_entries()},
                 "env": {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES",
                                                        "PYTHONPATH")}},
        "groups": {},
    }
    try:
        for group in selected_groups(args):
            left_s = args.budget_s - (time.monotonic() - started)
            cap_s = cap_of(group, args)
            print(f"=== {group.gid} {group.name} (cap {cap_s:.0f} s, {left_s:.0f} s left)", flush=True)
            if left_s < cap_s or cap_s <= 0:
                part = {"status": "skipped", "wall_s": 0.0, "reason": "budget", "checks": [], "figures": {},
                        "error_tail": None}
            else:
                part = run_child(group, args, cap_s, report, keep_models, work_dir)
            report["groups"][group.gid] = part
            if group.gid == "g0":
                figures = part.get("figures", {})
                for key in ("versions", "device", "ceilings"):
                    report["meta"][key] = figures.get(key, {})
                write_env(out_dir, report)
            print(f"--- {group.gid} {group.name}: {part['status'].upper()} in {part['wall_s']:.1f} s"
                  + (f" ({part['reason']})" if part.get("reason") else ""), flush=True)
            if part["status"] in ("error", "timeout") and part.get("error_tail"):
                print(part["error_tail"][-1500:], flush=True)
            report["meta"]["wall_s"] = round(time.monotonic() - started, 1)
            report["meta"]["triton_cache"]["after"] = triton_cache_entries()
            write_report(out_dir, report)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    report["meta"]["wall_s"] = round(time.monotonic() - started, 1)
    report["meta"]["triton_cache"]["after"] = triton_cache_entries()
    write_report(out_dir, report)
    write_env(out_dir, report)
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

