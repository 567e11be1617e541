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


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so a killed server leaves no orphans."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # parent already gone before prctl took effect
        os._exit(1)
    # Ctrl-C reaches the whole process group; the parent turns it into an orderly stop of its children.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def setup_logging(level: str, who: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {who} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
