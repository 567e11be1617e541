"""The multi-node rendezvous store behind the cluster key: a key-value store (torch.distributed's TCPStore's
operations) served by node 0 over one CURVE ZeroMQ socket at --dist-init-addr.

torch's TCPStore has no authentication: anyone who reaches its port can read and write its keys (the nodes'
endpoints, the process group's addresses) and stop the cluster. This store answers only holders of
--cluster-key-file (protocol/curve.py: a peer without the key fails the handshake, and the refusal is logged), and
its traffic is encrypted. `torch_store(client)` wraps a client as a torch.distributed Store, so the ranks make their
process group through it too; the module itself does not import torch (the scheduler never does).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import msgspec
import zmq
from loraplex.protocol.curve import ClusterKey, _watch_refusals

logger = logging.getLogger("loraplex.store")
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode
POLL_INTERVAL_S = 0.01  # how often a blocking get or wait looks again for its keys
# torch holds a Python store only on its C++ side, which does not keep the Python object (and its methods) alive:
# every store made here stays referenced for the process's life (a handful: one per group, one per clone).
_TORCH_STORES: list = []


class StoreError(RuntimeError):
    pass


def _apply(data: dict[str, bytes], op: str, args: list) -> object:
    """One operation on the store's map, with TCPStore's meaning."""
    if op == "set":
        data[args[0]] = args[1]
        return None
    if op == "get":
        return data.get(args[0])
    if op == "add":
        value = int(data.get(args[0], b"0")) + args[1]
        data[args[0]] = str(value).encode()
        return value
    if op == "check":
        return all(key in data for key in args[0])
    if op == "compare_set":  # set when the value is `expected` (or absent and expected is empty); returns the value
        key, expected, desired = args
        current = data.get(key)
        if (current is None and expected == b"") or current == expected:
            data[key] = desired
            return desired
        return expected if current is None else current
    if op == "delete_key":
        return data.pop(args[0], None) is not None
    if op == "num_keys":
        return len(data)
    if op == "append":
        data[args[0]] = data.get(args[0], b"") + args[1]
        return None
    if op == "list_keys":
        return sorted(data)
    raise StoreError(f"unknown store operation {op!r}")


class CurveStoreServer:
    """Node 0's store: a ROUTER bound at tcp://HOST:PORT with the cluster key, served from a daemon thread."""

    def __init__(self, host: str, port: int, key: ClusterKey):
        self.addr = f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
        # the process's shared context, never terminated: the key's ZAP handler and refusal monitor live in it
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.linger = 0
        key.secure(self._sock, self.addr, bind=True)
        self._sock.bind(self.addr)
        self._data: dict[str, bytes] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="curve-store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            peer, request = self._sock.recv_multipart()
            seq, op, args = _decode(request)
            try:
                reply = [seq, True, _apply(self._data, op, args)]
            except (StoreError, ValueError, TypeError, IndexError) as e:
                reply = [seq, False, str(e)]
            self._sock.send_multipart([peer, _encode(reply)])
        self._sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class CurveStoreClient:
    """A connection to node 0's store; every call waits at most `timeout` for the reply (StoreError after)."""

    def __init__(self, host: str, port: int, key: ClusterKey, timeout: timedelta = timedelta(seconds=300)):
        self.addr = f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
        self._args = (host, port, key)
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.linger = 0
        key.secure(self._sock, self.addr, bind=False)
        _watch_refusals(self._sock)  # a node with another key says so in its log, not only node 0
        self._sock.connect(self.addr)
        self._lock = threading.Lock()  # one request in flight: torch may call from several threads
        self._seq = 0
        self.timeout = timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def clone(self) -> CurveStoreClient:
        """Another connection to the same store (gloo opens one per thread that uses the store)."""
        return CurveStoreClient(*self._args, timeout=self.timeout)

    def _call(self, op: str, *args: object) -> object:
        with self._lock:
            self._seq += 1
            self._sock.send(_encode([self._seq, op, list(args)]))
            deadline = time.monotonic() + self.timeout.total_seconds()
            while True:  # a reply to an earlier call that timed out is dropped
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not self._sock.poll(left_ms):
                    raise StoreError(f"the store at {self.addr} did not answer {op} within "
                                     f"{self.timeout.total_seconds():.0f} s (node 0 gone, or this node's "
                                     "--cluster-key-file differs from node 0's)")
                seq, ok, value = _decode(self._sock.recv())
                if seq == self._seq:
                    break
        if not ok:
            raise StoreError(value)
        return value

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        """The key's value, waiting for it to be set (as TCPStore's get does) up to the timeout."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while (value := self._call("get", key)) is None:
            if time.monotonic() > deadline:
                raise StoreError(f"key {key!r} not set in the store within {self.timeout.total_seconds():.0f} s")
            time.sleep(POLL_INTERVAL_S)
        return value

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, int(amount))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise StoreError(f"keys {keys} not set in the store within {limit:.0f} s")
            time.sleep(POLL_INTERVAL_S)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        as_bytes = [v.encode() if isinstance(v, str) else bytes(v) for v in (expected, desired)]
        return self._call("compare_set", key, *as_bytes)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    def append(self, key: str, value: bytes | str) -> None:
        self._call("append", key, value.encode() if isinstance(value, str) else bytes(value))

    def list_keys(self) -> list[str]:
        return self._call("list_keys")

    def close(self) -> None:
        self._sock.close()


def torch_store(client: CurveStoreClient):
    """The client as a torch.distributed Store (for init_process_group(store=...)); torch is imported here only."""
    import torch.distributed as dist

    class _TorchCurveStore(dist.Store):
        def __init__(self) -> None:
            super().__init__()

        def clone(self):
            return torch_store(client.clone())

        def set(self, key, value):
            client.set(key, value)

        def get(self, key):
            return client.get(key)

        def add(self, key, amount):
            return client.add(key, amount)

        def check(self, keys):
            return client.check(keys)

        def wait(self, keys, timeout=None):
            client.wait(keys, timeout)

        def compare_set(self, key, expected, desired):
            return client.compare_set(key, expected, desired)

        def delete_key(self, key):
            return client.delete_key(key)

        def num_keys(self):
            return client.num_keys()

        def append(self, key, value):
            client.append(key, value)

        def multi_get(self, keys):
            return [client.get(key) for key in keys]

        def multi_set(self, keys, values):
            for key, value in zip(keys, values, strict=True):
                client.set(key, value)

        def list_keys(self):
            return client.list_keys()

        def has_extended_api(self):
            return True

        def set_timeout(self, timeout):
            client.set_timeout(timeout)

    store = _TorchCurveStore()
    _TORCH_STORES.append(store)
    return store
