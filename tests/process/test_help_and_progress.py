"""`loraplex --help` groups its flags by topic; long start-up work (checkpoint loading, kernel builds) reports
progress: log lines when stderr is not a terminal, a tqdm bar when it is."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from loraplex.frontend.entrypoints.cli import _TOPICS, FOREIGN_TOPIC, OTHER_TOPIC, field_topic
from loraplex.kernels import progress
from loraplex.kernels.progress import Progress, elapsed
from loraplex.protocol.config import ALIASES, ServerConfig

REPO = Path(__file__).resolve().parents[2]


def _help_sections(text: str) -> dict[str, list[str]]:
    """heading -> the flags listed under it, in order."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if re.fullmatch(r"[A-Za-z][\w ,-]*:", line):
            current = line[:-1]
            sections[current] = []
        elif current is not None:
            sections[current] += re.findall(r"^\s{2}(--[\w-]+)", line)
    return sections


def test_help_groups_flags_by_topic() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "loraplex.frontend.entrypoints.launch", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    sections = _help_sections(result.stdout)
    assert list(sections)[1:] == [*_TOPICS, FOREIGN_TOPIC]  # after argparse's own "options:" (just --help)
    assert sections["LoRA adapters"][:3] == ["--enable-lora", "--lora-paths", "--lora-modules"]
    assert "--max-loras" in sections["LoRA adapters"]  # vLLM's spelling sits beside ours
    assert {"--port", "--api-key"} <= set(sections["HTTP server and access"])
    assert {"--nnodes", "--dist-init-addr"} <= set(sections["multi-node"])
    listed = [flag for flags in sections.values() for flag in flags]
    assert len(listed) == len(set(listed))


def test_every_config_field_has_a_topic() -> None:
    # A new field must be given a topic in frontend/entrypoints/cli.py's _TOPICS, not left in "other options".
    fields = [field.name for field in msgspec.structs.fields(ServerConfig)]
    assert [name for name in fields if field_topic(name) == OTHER_TOPIC] == []
    named = [name for names in _TOPICS.values() for name in names.split()]
    assert sorted(named) == sorted(fields)  # each exactly once, and no stale names
    assert set(ALIASES.values()) <= set(fields)


def _progress_lines(caplog: pytest.LogCaptureFixture, what: str) -> list[str]:
    return [m for m in caplog.messages if m.startswith(what + ":")]


def test_progress_logs_about_every_tenth(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    logger = logging.getLogger("test.progress")
    with Progress(logger, "copying", 25, "files") as bar:
        for _ in range(25):
            bar.update()
    lines = _progress_lines(caplog, "copying")
    assert lines[0].startswith("copying: 1/25 files (4%")
    assert lines[-1].startswith("copying: 25/25 files (100%")
    assert 10 <= len(lines) <= 12
    done = [int(re.match(r"copying: (\d+)/", line)[1]) for line in lines]
    assert done == sorted(done)

    caplog.clear()
    with pytest.raises(RuntimeError), Progress(logger, "failing", 100, "items") as bar:
        bar.update(37)  # logged on crossing 30%
        bar.update(1)
        raise RuntimeError("stop")
    assert _progress_lines(caplog, "failing")[-1].startswith("failing: 38/100 items")  # where it stopped

    caplog.clear()
    with Progress(logger, "quiet", 5, "items", enabled=False) as bar:
        bar.update(5)
    assert _progress_lines(caplog, "quiet") == []


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_a_bar_on_a_terminal(monkeypatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with Progress(logging.getLogger("test.progress"), "loading", 4, "tensors") as bar:
        for _ in range(4):
            bar.update()
    assert "loading:" in terminal.getvalue() and "/4 [" in terminal.getvalue()  # tqdm redraws at most 10 times a second
    assert _progress_lines(caplog, "loading") == []  # the bar, not log lines


def test_elapsed_logs_while_work_runs(monkeypatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.05)
    with elapsed(logging.getLogger("test.progress"), "compiling"):
        time.sleep(0.4)
    lines = _progress_lines(caplog, "compiling")
    assert len(lines) >= 3 and all("still running" in line for line in lines)


def test_checkpoint_load_logs_progress(llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tests.worker_helpers import make_runner

    caplog.set_level(logging.INFO, logger="loraplex.worker.loader")
    make_runner(llama_dir)
    lines = _progress_lines(caplog, f"loading {llama_dir}")
    num_tensors = len(__import__("safetensors").safe_open(llama_dir / "model.safetensors", "pt").keys())
    assert lines[-1].startswith(f"loading {llama_dir}: {num_tensors}/{num_tensors} tensors (100%")
    assert 5 <= len(lines) <= 12


def test_cpu_kernel_build_reports_while_it_compiles(monkeypatch, caplog: pytest.LogCaptureFixture) -> None:
    import torch.utils.cpp_extension
    from loraplex.kernels import cpu_ext

    caplog.set_level(logging.INFO, logger="loraplex.kernels.cpu_ext")
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(cpu_ext, "unavailable_reason", lambda: None)
    built = object()
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: time.sleep(0.3) or built)
    assert cpu_ext._build() is built
    assert len(_progress_lines(caplog, "building the CPU kernels")) >= 2
    assert any(m.startswith("CPU kernels ready in") for m in caplog.messages)
