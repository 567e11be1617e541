"""Worker processes started as the launcher starts them (`python -m loraplex.worker`), with the test playing the
scheduler's end of their sockets (FakeScheduler); always killed on the way out."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loraplex.protocol.config import ServerConfig
from loraplex.protocol.proc import ARGS_ENV, encode_process_args
from loraplex.protocol.structs import ProcessArgs

from tests.server_utils import fault_env, ipc_endpoints
from tests.worker_helpers import FakeScheduler

REPO_ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def start_workers(
    model_dir: str | Path, tp: int = 1, faults: dict[str, object] | None = None,
    extra_env: dict[str, str] | None = None, **config_kwargs
) -> Iterator[tuple[list[subprocess.Popen], FakeScheduler]]:
    with ipc_endpoints(tp) as endpoints:
        config = ServerConfig(device="cpu", tp=tp, page_size=4, max_total_tokens=256, **config_kwargs)
        scheduler = FakeScheduler(endpoints)
        procs = []
        try:
            for rank in range(tp):
                args = ProcessArgs(config=config, endpoints=endpoints, model_dir=str(model_dir), local_rank=rank)
                env = {**os.environ, ARGS_ENV: encode_process_args(args), "PYTHONPATH": str(REPO_ROOT),
                       **fault_env(**(faults or {})), **(extra_env or {})}
                if tp > 1:
                    env["OMP_NUM_THREADS"] = "1"  # the ranks share the machine's cores
                procs.append(subprocess.Popen([sys.executable, "-m", "loraplex.worker"], cwd=REPO_ROOT, env=env))
            yield procs, scheduler
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=10)
            scheduler.close()
