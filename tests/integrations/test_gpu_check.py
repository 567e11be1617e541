"""scripts/gpu_check.py --dry-run end to end: every group runs (or skips with a reason) on the CPU, the merged JSON
has the documented shape, the reviewer block is printed, and no check that ran failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
GROUPS = ("g0", "g1", "g2", "g3", "g4", "g5", "g6", "g7", "g8")
STATUSES = {"pass", "fail", "error", "timeout", "skipped"}
DRY_RUN_TIMEOUT_S = 420


def test_gpu_check_dry_run(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--dry-run", "--out",
                           str(out_dir)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=DRY_RUN_TIMEOUT_S)
    stdout = proc.stdout
    report = json.loads((out_dir / "gpu_check.json").read_text())

    assert set(report["groups"]) == set(GROUPS), stdout[-3000:]
    for gid, group in report["groups"].items():
        assert group["status"] in STATUSES, gid
        assert (out_dir / f"part_{gid}.json").exists(), gid
        assert group["status"] not in ("error", "timeout"), f"{gid}: {group['reason']}\n{group['error_tail']}"
        for check in group["checks"]:
            assert set(check) >= {"name", "kind", "pass", "value", "threshold", "detail"}, check
            assert check["kind"] in ("check", "flag", "skip"), check
            if check["kind"] == "skip":
                assert check["detail"], f"{gid}.{check['name']} skipped without a reason"
            elif check["kind"] == "check":
                assert check["pass"] is True, f"{gid}.{check['name']}: {check}"
    ran = [c for g in report["groups"].values() for c in g["checks"] if c["kind"] == "check"]
    assert len(ran) >= 40, f"only {len(ran)} checks ran"
    for key in ("started", "wall_s", "budget_s", "git", "versions", "device", "ceilings", "env"):
        assert key in report["meta"], key
    summary = report["summary"]
    assert summary["fail"] == 0 and summary["error"] == 0, summary
    assert summary["tp2_backend"] == "gloo-cpu"
    for line_start in ("=== loraplex GPU check:", "RESULT:", "CEILINGS:", "KERNELS:", "ATTENTION:", "NUMERICS:",
                       "DECODE 1B", "PREFILL:", "DYNAMIC LORA:", "SERVER:", "TP2 one GPU", "SANITIZER:",
                       "PERF FLAGS:"):
        assert any(line.lstrip().startswith(line_start) for line in stdout.splitlines()), line_start
    assert stdout.rstrip().splitlines()[-1].startswith("PERF FLAGS:")
    assert proc.returncode == 0, proc.stderr[-3000:]
