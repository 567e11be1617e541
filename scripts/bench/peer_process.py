"""A peer server the benchmarks run beside loraplex (llama-server, vLLM): one process group of its own, its output in
a log file, waited on `/health` with a deadline, stopped with the whole group (what its leader spawned too)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import requests


class PeerProcess:
    def __init__(self, name: str, cmd: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None,
                 cwd: str | None = None):  # fmt: skip
        self.name, self.log_path = name, log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:] + f"\n(log: {self.log_path})"

    def wait_healthy(self, url: str, timeout_s: float, exited: Callable[[int], BaseException]) -> None:
        """Returns once GET url/health answers 200; raises exited(returncode) if the process ends first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise exited(self.proc.returncode)
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} not healthy in {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, term_wait_s: float) -> None:
        """SIGTERM to the group, SIGKILL if the leader outlives term_wait_s, then SIGKILL to whatever is left."""
        for sig, wait_s in ((signal.SIGTERM, term_wait_s), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait_s)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
