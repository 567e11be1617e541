"""Start a real server in a subprocess for a test: free port, wait on /health with a deadline, always stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import requests
from loraplex.frontend.cluster.process_group import make_endpoints
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.faults import FAULTS_ENV, FaultPlan
from loraplex.protocol.structs import Endpoints

from tests.net import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The server's command line, as the installed `loraplex` runs it (the tests do not go through scripts/)
LAUNCH = (sys.executable, "-m", "loraplex.frontend.entrypoints.launch")
# A server that prefills in chunks of 8 tokens over pages of 4 (reference.SHARED_PREFIX_PROMPTS)
CHUNKED_ARGS = ("--chunked-prefill-size", "8", "--page-size", "4", "--max-total-tokens", "2048",
                "--context-length", "256")  # fmt: skip


def fault_env(**faults: object) -> dict[str, str]:
    """The environment that injects these faults (protocol/faults.py) into every worker started under it."""
    return {FAULTS_ENV: msgspec.json.encode(FaultPlan(**faults)).decode()}


class ServerProcess:
    def __init__(self, *args: str, start_timeout_s: float = 180.0, env: dict[str, str] | None = None,
                 argv_prefix: tuple[str, ...] = (), healthy: bool = True):
        """argv_prefix comes first on the command line, before the port and device flags: ("serve", MODEL) starts
        the `loraplex serve MODEL [flags]` form. healthy=False: return at once (a server expected never to become
        healthy; wait_log watches it)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [*LAUNCH, *argv_prefix,
               "--port", str(self.port), "--device", "cpu", *args]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}  # env may turn the Hub back on
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"loraplex-test-{self.port}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            if healthy:
                self.wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not healthy after {timeout_s} s:\n{self.log()}")

    def wait_log(self, text: str, timeout_s: float) -> bool:
        """Whether `text` appears in the server's log within timeout_s (False at once if the server exits)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._log.flush()
            with open(self.log_path) as f:
                if text in f.read():
                    return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.25)
        return False

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-6000:]

    def post(self, path: str, json: object, timeout: float = 120, **kwargs) -> requests.Response:
        return requests.post(self.url + path, json=json, timeout=timeout, **kwargs)

    def get(self, path: str, timeout: float = 30, **kwargs) -> requests.Response:
        return requests.get(self.url + path, timeout=timeout, **kwargs)

    def child_pids(self) -> list[int]:
        info = self.get("/server_info").json()
        return list(info["process_ids"].values())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # children of a killed server: the whole session goes
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_test_endpoints(sock_dir: str | Path, tp: int = 1) -> Endpoints:
    """The sockets of one replica in `sock_dir`, named as the server names them (one rule for every harness)."""
    return make_endpoints(ServerConfig(device="cpu", tp=tp), str(sock_dir))


@contextmanager
def ipc_endpoints(tp: int = 1) -> Iterator[Endpoints]:
    """make_test_endpoints in a short private directory: ipc:// paths are limited to ~100 characters."""
    with tempfile.TemporaryDirectory(prefix="lpx") as sock_dir:
        yield make_test_endpoints(sock_dir, tp)
