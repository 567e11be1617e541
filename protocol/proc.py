"""Start-up helpers every child process shares: read its arguments, die with its parent, set up logging."""

from __future__ import annotations

import base64
import ctypes
import logging
import os
import signal
import sys

import msgspec
from loraplex.protocol.structs import ProcessArgs

ARGS_ENV = "LORAPLEX_PROCESS_ARGS"


def encode_process_args(args: ProcessArgs) -> str:
    # Passed in the environment, not argv, so API keys never show in `ps`.
    return base64.b64encode(msgspec.msgpack.encode(args)).decode()


def read_process_args() -> ProcessArgs:
    return msgspec.msgpack.decode(base64.b64decode(os.environ[ARGS_ENV]), type=ProcessArgs)


PARENT_PID_ENV = "LORAPLEX_PARENT_PID"  # set by the spawning server for its children (die_with_parent)


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so a killed server leaves no orphans."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # The parent already gone before prctl took effect: we were re-parented. Compared with the pid the parent gave,
    # not with 1: a server that is PID 1 itself (a container's entrypoint) has children whose parent is 1.
    expected = os.environ.get(PARENT_PID_ENV)
    if (os.getppid() != int(expected)) if expected else os.getppid() == 1:
        os._exit(1)
    # Ctrl-C reaches the whole process group; the parent turns it into an orderly stop of its children.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def setup_logging(level: str, who: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {who} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
