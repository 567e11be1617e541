"""Network namespaces for the deploy tests (`ip netns`, root only): a namespace of its own per server, and calls made
from inside one without a subprocess (setns moves only the calling thread, so each call runs on a thread of its own).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class NetNS:
    """A named network namespace with its loopback up; deleted (with every interface in it) on exit."""

    def __init__(self, name: str):
        self.name = name
        _ip("netns", "add", name)
        _ip("-n", name, "link", "set", "lo", "up")

    def prefix(self) -> list[str]:
        """The command prefix that runs a program in this namespace."""
        return ["ip", "netns", "exec", self.name]

    def call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        """fn(*args, **kwargs) on a thread inside this namespace: its sockets live there."""
        result: list = []

        def run() -> None:
            try:
                with open(f"/var/run/netns/{self.name}") as ns:
                    if _libc.setns(ns.fileno(), CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), f"setns {self.name}: {os.strerror(ctypes.get_errno())}")
                result.append((True, fn(*args, **kwargs)))
            except BaseException as e:  # handed to the caller's thread
                result.append((False, e))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join()
        ok, value = result[0]
        if not ok:
            raise value
        return value

    def delete(self) -> None:
        subprocess.run(["ip", "netns", "delete", self.name], capture_output=True)

    def __enter__(self) -> NetNS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()


def bridged_hosts(prefix: str, count: int, subnet: str = "10.77.0") -> tuple[NetNS, list[tuple[NetNS, str]]]:
    """`count` hosts on one Ethernet segment: a switch namespace with a bridge (br0), and per host a namespace whose
    eth0 (a veth into the bridge) has SUBNET.(i + 1)/24. Returns (the switch, [(host, its address)]); the caller
    deletes them all (deleting a namespace takes its veth with it)."""
    switch = NetNS(f"{prefix}-sw")
    _ip("-n", switch.name, "link", "add", "br0", "type", "bridge")
    _ip("-n", switch.name, "link", "set", "br0", "up")
    hosts = []
    for i in range(count):
        host, addr = NetNS(f"{prefix}-h{i}"), f"{subnet}.{i + 1}"
        _ip("-n", switch.name, "link", "add", f"port{i}", "type", "veth", "peer", "name", "eth0", "netns", host.name)
        _ip("-n", switch.name, "link", "set", f"port{i}", "master", "br0", "up")
        _ip("-n", host.name, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", host.name, "link", "set", "eth0", "up")
        hosts.append((host, addr))
    return switch, hosts
