"""A loraplex server in a subprocess for scripts/gpu_check/runner.py's G5, with only the standard library as its client
(urllib: the GPU image has what `pip install .` brings, and `requests` is not among it).

The server runs in a session of its own (its scheduler and workers with it), registered with the group's Context:
the parent kills that process group when the group ends or is killed at its cap, so a server never outlives its
group and holds GPU memory through the next ones. Its log goes to the run's scratch directory, not to --out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from scripts.gpu_check.lib import REPO_ROOT, Context
from tests.net import free_port


class CheckServer:
    def __init__(self, ctx: Context, *args: str, start_timeout_s: float, name: str = "server"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = ctx.scratch / f"{ctx.group}_{name}.log"
        cmd = [sys.executable, "-m", "scripts.launch_server", "--port", str(self.port), *args]
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        ctx.own_process_group(self.proc.pid)
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy after {timeout_s} s:\n{self.log()[-3000:]}")

    def post(self, path: str, body: object, timeout: float = 120) -> dict:
        """POST JSON, the reply's JSON; an HTTP error raises with the server's message."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"POST {path}: HTTP {e.code}: {e.read()[:500]!r}") from e

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        try:  # the scheduler and workers too: the whole session goes
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
