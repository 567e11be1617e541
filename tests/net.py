"""A free local port. Its own module, without `requests`: scripts/gpu_check imports test helpers on a GPU image that
has only the package's own dependencies."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
