"""`python -m scripts.gpu_check --dry-run` end to end: every group runs (or skips with a reason) on the CPU, the merged
JSON has the documented shape, at most 6 files come back, the reviewer block is printed, and no check that ran failed.
Also: the plan is two device calls that fit the session's device time, the wheels brought cover their dependencies,
and the check imports without `requests` or pytest."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from scripts.gpu_check.plan import (
    CALL_LIMIT_S,
    DEVICE_CALL_S,
    IMAGE_PACKAGES,
    INSTALL_S,
    MACHINE_START_S,
    SESSION_DEVICE_S,
    plan_lines,
    planned_calls,
    selected_groups,
)
from scripts.gpu_check.runner import parse_args

REPO_ROOT = Path(__file__).resolve().parents[2]
GROUPS = ("g0", "g1", "g2", "g3", "g4", "g5", "g5b", "g6", "g9", "g7")  # G8 (compute-sanitizer) only with --sanitizer
MAX_FILES = 6
STATUSES = {"pass", "fail", "error", "timeout", "skipped"}
DRY_RUN_TIMEOUT_S = 600


def test_gpu_check_dry_run(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--dry-run", "--out",
                           str(out_dir)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=DRY_RUN_TIMEOUT_S)
    stdout = proc.stdout
    report = json.loads((out_dir / "gpu_check.json").read_text())

    assert set(report["groups"]) == set(GROUPS), stdout[-3000:]
    files = [f for f in out_dir.rglob("*") if f.is_file()]
    assert len(files) + 1 <= MAX_FILES, files  # + the log the device command tees
    assert {f.name for f in files} <= {"gpu_check.json", "env.txt", "server_tail.log"}, files
    assert "triton_cache_entries" in (out_dir / "env.txt").read_text()
    for gid, group in report["groups"].items():
        assert group["status"] in STATUSES, gid
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
    for key in ("started", "wall_s", "budget_s", "git", "versions", "device", "ceilings", "env", "triton_cache"):
        assert key in report["meta"], key
    summary = report["summary"]
    assert summary["fail"] == 0 and summary["error"] == 0, summary
    assert summary["tp2_backend"] == "gloo-cpu"
    for line_start in ("=== loraplex GPU check:", "RESULT:", "CEILINGS:", "KERNELS:", "ATTENTION:", "NUMERICS:",
                       "DECODE 1B", "PREFILL:", "DYNAMIC LORA:", "SERVER:", "SERVER GRAPHS:", "TP2 one GPU",
                       "SANITIZER:", "VERSIONS:", "QUANTIZED",
                       "PERF FLAGS:"):
        assert any(line.lstrip().startswith(line_start) for line in stdout.splitlines()), line_start
    assert stdout.rstrip().splitlines()[-1].startswith("PERF FLAGS:")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_plan_is_two_calls_that_fit_the_session_with_room_for_a_rerun() -> None:
    """Correctness first, then speed and serving: each call ends inside its device call even with every group at its
    cap, together they run every default group once (G0 in both), and start + both calls leave a rerun's time."""
    args = parse_args(["--plan"])
    calls = planned_calls(args)
    assert [call.title for call in calls] == ["correctness", "speed and serving"]
    ran = [g.gid for call in calls for g in call.groups]
    assert sorted(set(ran)) == sorted(g.gid for g in selected_groups(args)) and ran.count("g0") == 2, ran
    assert {"g1", "g2", "g3"} <= {g.gid for g in calls[0].groups}
    assert {"g4", "g5", "g5b"} <= {g.gid for g in calls[1].groups}  # G5 serves G4's model, G5b reads G5's tokens
    text = "\n".join(plan_lines(args))
    commands = [line for line in text.splitlines() if line.startswith("set -o pipefail")]
    assert len(commands) == 2, text
    for call, command in zip(calls, commands, strict=True):
        assert call.worst_s <= CALL_LIMIT_S < DEVICE_CALL_S, (call.title, call.worst_s)
        timeout_s = int(re.search(r"timeout -k 10 (\d+) python3 -m scripts.gpu_check --out \$OUT", command).group(1))
        warm_s = int(re.search(r"timeout (\d+) python3 -m scripts.gpu_check --warm-imports", command).group(1))
        assert INSTALL_S + warm_s + timeout_s + 10 <= CALL_LIMIT_S, command
        assert f"--only {','.join(g.gid for g in call.groups)}" in command, command
        assert len(command) < 2000 and "tee -a $OUT/gpu_check.log" in command and "nvidia-smi" not in command
    expected = MACHINE_START_S + sum(call.expected_s for call in calls)
    assert expected + max(call.expected_s for call in calls) <= SESSION_DEVICE_S, text
    assert re.search(rf"= ~{expected:.0f} s of {SESSION_DEVICE_S} s device time; left for a rerun", text), text
    proc = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--plan"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and all(command in proc.stdout for command in commands), proc.stderr
    rerun = parse_args(["--plan", "--only", "g2", "--cap-scale", "1"])
    assert len(planned_calls(rerun)) == 1 and "--only g2 " in "\n".join(plan_lines(rerun))
    with_sanitizer = parse_args(["--plan", "--sanitizer"])
    assert "g8" in "\n".join(plan_lines(with_sanitizer))
    assert all(call.worst_s <= CALL_LIMIT_S for call in planned_calls(with_sanitizer))


def _wheel_list() -> dict[str, Requirement]:
    lines = (REPO_ROOT / "scripts" / "gpu_check" / "gpu_wheels.txt").read_text().splitlines()
    reqs = [Requirement(line.split(" #")[0]) for line in lines if line.strip() and not line.startswith("#")]
    return {canonicalize_name(r.name): r for r in reqs}


def _device_markers() -> dict[str, str]:
    """The marker environment of the interpreter fetch_gpu_wheels.sh downloads for (its --python-version and
    --platform)."""
    script = (REPO_ROOT / "scripts" / "gpu_check" / "fetch_gpu_wheels.sh").read_text()
    python = re.search(r"--python-version (\d+\.\d+)", script).group(1)
    machines = set(re.findall(r"--platform manylinux\w*?_(x86_64|aarch64)\b", script))
    assert len(machines) == 1 and "--implementation cp" in script and "--no-deps" in script, script
    return {"python_version": python, "python_full_version": f"{python}.0", "platform_system": "Linux",
            "sys_platform": "linux", "os_name": "posix", "platform_machine": machines.pop(),
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def test_gpu_wheels_cover_their_dependencies() -> None:
    """fetch_gpu_wheels.sh brings its wheels without their dependencies, so the list itself must hold every package
    they need at import (Requires-Dist, recursively, for the image's python and platform), but for the image's own.
    The installed metadata stands in for the wheels': it must be the pinned version's."""
    wheels, markers = _wheel_list(), _device_markers()
    image = {canonicalize_name(name) for name in IMAGE_PACKAGES}
    assert not wheels.keys() & image, "a wheel would shadow the image's package"
    missing, unmet, todo, seen = [], [], list(wheels), set()
    while todo:
        name = todo.pop()
        if name in seen or name in image:
            continue
        seen.add(name)
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            missing.append(f"{name}: not installed here, its requirements unknown")
            continue
        assert dist.version in wheels[name].specifier, f"{name}: {dist.version} here, {wheels[name]} brought"
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(markers):
                continue
            dep = canonicalize_name(req.name)
            if dep in image:
                continue
            if dep not in wheels:
                missing.append(f"{dep} (required by {name}: {text})")
                continue
            pinned = [s.version for s in wheels[dep].specifier if s.operator == "=="]
            if pinned and not req.specifier.contains(pinned[0], prereleases=True):
                unmet.append(f"{name} needs {req}, {wheels[dep]} brought")
            todo.append(dep)
    assert not missing and not unmet, (missing, unmet)
    assert {"xgrammar", "apache-tvm-ffi", "pydantic", "pydantic-core"} <= seen
    doc = (REPO_ROOT / "scripts" / "gpu_check" / "GPU_CHECK.md").read_text()
    for name in IMAGE_PACKAGES:
        assert name in doc, f"GPU_CHECK.md does not say the image has {name}"


def test_check_imports_without_requests_or_pytest() -> None:
    """The GPU image has what `pip install .` brings: every gpu_check module and the test helpers it uses import
    with `requests` and pytest unavailable."""
    code = ("import sys; sys.modules['requests'] = None; sys.modules['pytest'] = None\n"
            "import scripts.gpu_check.runner, scripts.gpu_check.model, scripts.gpu_check.kernels\n"
            "import scripts.gpu_check.serving, scripts.gpu_check.tp, scripts.gpu_check.server\n"
            "import scripts.bench.serving, scripts.bench.adapter_ops\n"
            "import scripts.gpu_check.quant, loraplex.worker.quant.matmul\n"
            "import tests.worker_helpers, tests.adapter_specs, tests.reference, tests.kernel_refs\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
