"""Start a real server in a subprocess for a test: free port, wait on /health with a deadline, always stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import requests

from tests.net import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ServerProcess:
    def __init__(self, *args: str, start_timeout_s: float = 180.0, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, os.path.join(REPO_ROOT, "scripts", "launch_server.py"), "--port", str(self.port),
               "--device", "cpu", *args]
        full_env = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"loraplex-test-{self.port}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
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
