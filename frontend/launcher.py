"""ProcessGroup: starts the scheduler and the worker ranks as child processes, watches them, stops them."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from protocol.config import ServerConfig
from protocol.proc import ARGS_ENV, encode_process_args
from protocol.structs import Endpoints, ProcessArgs

logger = logging.getLogger("loraplex.launcher")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def make_endpoints(config: ServerConfig, ipc_dir: str) -> Endpoints:
    # ipc paths in a private temp dir and a free rendezvous port: several servers can share one host.
    local_ranks = config.tp // config.nnodes
    return Endpoints(
        frontend_to_scheduler=f"ipc://{ipc_dir}/to_scheduler",
        scheduler_to_frontend=f"ipc://{ipc_dir}/to_frontend",
        scheduler_to_workers=[f"ipc://{ipc_dir}/to_worker{i}" for i in range(local_ranks)],
        workers_to_scheduler=f"ipc://{ipc_dir}/to_scheduler_from_workers",
        scheduler_to_loaders=[f"ipc://{ipc_dir}/to_loader{i}" for i in range(local_ranks)],
        dist_init_addr=config.dist_init_addr or f"127.0.0.1:{free_port()}",
    )


class ProcessGroup:
    """The child processes of one server or Engine. Only this object starts or stops them."""

    def __init__(self, config: ServerConfig, model_dir: str, fault_hooks: dict[str, str] | None = None):
        self.config = config
        self.ipc_dir = tempfile.mkdtemp(prefix="loraplex-")
        self.endpoints = make_endpoints(config, self.ipc_dir)
        self.model_dir = model_dir
        self.fault_hooks = fault_hooks or {}
        self.procs: dict[str, subprocess.Popen] = {}
        self._stop_lock = threading.Lock()  # stop() runs in executor threads: on a failure, then at shutdown

    def start(self) -> None:
        local_ranks = self.config.tp // self.config.nnodes
        first_rank = self.config.node_rank * local_ranks
        if self.config.node_rank == 0:
            self._spawn("scheduler", "scheduler", rank=0)
        for local_rank in range(local_ranks):
            self._spawn(f"worker{first_rank + local_rank}", "worker", rank=local_rank)

    def _spawn(self, name: str, module: str, rank: int) -> None:
        args = ProcessArgs(
            config=self.config,
            endpoints=self.endpoints,
            model_dir=self.model_dir,
            rank=rank,
            fault_hooks=self.fault_hooks,
        )
        env = dict(os.environ, **{ARGS_ENV: encode_process_args(args)})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
        logger.info("starting %s", name)
        self.procs[name] = subprocess.Popen([sys.executable, "-m", module], env=env)

    def dead(self) -> tuple[str, int] | None:
        """(name, exit code) of the first child that has exited, if any."""
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return name, code
        return None

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every child still running, SIGKILL those alive after grace_s. Safe to call again."""
        with self._stop_lock:
            self._stop(grace_s)

    def _stop(self, grace_s: float) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
