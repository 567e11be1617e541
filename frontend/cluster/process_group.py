"""ProcessGroup: starts the scheduler and the worker ranks of every data-parallel replica as child processes, watches
them, stops them."""

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

from loraplex.protocol.config import ServerConfig
from loraplex.protocol.proc import ARGS_ENV, PARENT_PID_ENV, encode_process_args
from loraplex.protocol.structs import Endpoints, ProcessArgs

logger = logging.getLogger("loraplex.launcher")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def make_endpoints(config: ServerConfig, ipc_dir: str, dp_rank: int = 0) -> Endpoints:
    # ipc paths in a private temp dir and a free rendezvous port: several servers (and replicas) can share one host.
    local_ranks = config.tp // config.nnodes
    prefix = f"ipc://{ipc_dir}/dp{dp_rank}_"
    if config.dist_init_addr:  # replica r meets at port + r
        host, port = config.dist_init_addr.rsplit(":", 1)
        dist_init_addr = f"{host}:{int(port) + dp_rank}"
    else:
        dist_init_addr = f"127.0.0.1:{free_port()}"
    return Endpoints(
        frontend_to_scheduler=f"{prefix}to_scheduler",
        scheduler_to_frontend=f"{prefix}to_frontend",
        scheduler_to_workers=[f"{prefix}to_worker{i}" for i in range(local_ranks)],
        workers_to_scheduler=f"{prefix}to_scheduler_from_workers",
        scheduler_to_loaders=[f"{prefix}to_loader{i}" for i in range(local_ranks)],
        dist_init_addr=dist_init_addr,
    )


class ProcessGroup:
    """The child processes of one server or Engine. Only this object starts or stops them."""

    def __init__(self, config: ServerConfig, model_dir: str):
        self.config = config
        self.ipc_dir = tempfile.mkdtemp(prefix="loraplex-")
        # per replica; with several nodes, set from the nodes' rendezvous before start() (node_rendezvous.py)
        self.endpoints = [make_endpoints(config, self.ipc_dir, dp_rank) for dp_rank in range(config.dp_size)]
        self.model_dir = model_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self._stop_lock = threading.Lock()  # stop() runs in executor threads: on a failure, then at shutdown

    def start(self) -> None:
        """Each replica's scheduler and ranks, named `scheduler`, `worker0`, ... (`dp1.worker0` under --dp-size)."""
        local_ranks = self.config.tp // self.config.nnodes
        first_rank = self.config.node_rank * local_ranks
        for dp_rank in range(self.config.dp_size):
            prefix = f"dp{dp_rank}." if self.config.dp_size > 1 else ""
            if self.config.node_rank == 0:
                self._spawn(f"{prefix}scheduler", "loraplex.scheduler", 0, dp_rank)
            for local_rank in range(local_ranks):
                self._spawn(f"{prefix}worker{first_rank + local_rank}", "loraplex.worker", local_rank, dp_rank)

    def _spawn(self, name: str, module: str, local_rank: int, dp_rank: int) -> None:
        args = ProcessArgs(
            config=self.config,
            endpoints=self.endpoints[dp_rank],
            model_dir=self.model_dir,
            local_rank=local_rank,
            dp_rank=dp_rank,
        )
        env = dict(os.environ, **{ARGS_ENV: encode_process_args(args), PARENT_PID_ENV: str(os.getpid())})
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

    def exit_codes(self) -> dict[str, int | None]:
        """Each child's exit code; None while it runs."""
        return {name: proc.poll() for name, proc in self.procs.items()}

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
