"""Typed ZeroMQ sockets: each socket encodes and decodes one union of protocol structs with msgpack.

A message is one frame, or one frame and raw extra frames (tensor bytes, never pickled) that travel with it
atomically: `send(msg, frames)` and `recv_with_frames()`. Given the cluster key, a TCP socket is CURVE-secured
(protocol/curve.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from loraplex.protocol.curve import ClusterKey

PUSH, PULL, ROUTER, DEALER = zmq.PUSH, zmq.PULL, zmq.ROUTER, zmq.DEALER


def _make(ctx: zmq.Context, kind: int, addr: str, bind: bool, key: ClusterKey | None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if key is not None:
        key.secure(sock, addr, bind)
    if kind == PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)
    if kind == PULL:
        sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock


class TypedSocket:
    """Blocking socket for the scheduler and workers."""

    def __init__(self, kind: int, addr: str, *, bind: bool, recv_type: Any = None, ctx: zmq.Context | None = None,
                 key: ClusterKey | None = None):
        self._ctx = ctx or zmq.Context.instance()
        self.sock = _make(self._ctx, kind, addr, bind, key)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(recv_type) if recv_type is not None else None

    def send(self, msg: msgspec.Struct, frames: Sequence[Any] = ()) -> None:
        """`frames`: raw buffers (bytes, memoryviews, zmq frames) sent after the message, not copied."""
        if frames:
            self.sock.send_multipart([self._encoder.encode(msg), *frames], copy=False)
        else:
            self.sock.send(self._encoder.encode(msg), copy=False)

    def recv(self, timeout_ms: int | None = None) -> Any:
        """Next message, or None if none arrived within timeout_ms (None = wait forever). Extra frames, on a socket
        whose reader does not expect them, are dropped."""
        got = self.recv_with_frames(timeout_ms)
        return None if got is None else got[0]

    def recv_with_frames(self, timeout_ms: int | None = None) -> tuple[Any, list[zmq.Frame]] | None:
        """(next message, its extra frames), or None if none arrived within timeout_ms."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms, zmq.POLLIN):
            return None
        first, *frames = self.sock.recv_multipart(copy=False)
        return self._decoder.decode(first.buffer), frames

    def close(self) -> None:
        self.sock.close(linger=0)


def send_last(addr: str, msg: msgspec.Struct, linger_ms: int, key: ClusterKey | None = None) -> None:
    """Send one message from a process about to exit. The socket gets its own context, so terminating it waits
    (up to linger_ms) for this message alone, not for the process's other sockets to close."""
    ctx = zmq.Context()
    typed = TypedSocket(PUSH, addr, bind=False, ctx=ctx, key=key)
    typed.send(msg)
    typed.sock.close(linger=linger_ms)
    ctx.term()


def wait_readable(sockets: list[TypedSocket], timeout_ms: int) -> bool:
    """Block until any of the sockets has a message, or timeout_ms passes; True if one has."""
    poller = zmq.Poller()
    for typed in sockets:
        poller.register(typed.sock, zmq.POLLIN)
    return bool(poller.poll(timeout_ms))


class AsyncTypedSocket:
    """asyncio socket for the frontend and the RPC client."""

    def __init__(
        self, kind: int, addr: str, *, bind: bool, recv_type: Any = None, ctx: zmq.asyncio.Context | None = None
    ):
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self.sock = _make(self._ctx, kind, addr, bind, None)  # the frontend's scheduler sockets: IPC only
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(recv_type) if recv_type is not None else None

    async def send(self, msg: msgspec.Struct, frames: Sequence[Any] = ()) -> None:
        if frames:
            await self.sock.send_multipart([self._encoder.encode(msg), *frames], copy=False)
        else:
            await self.sock.send(self._encoder.encode(msg), copy=False)

    async def recv(self) -> Any:
        return self._decoder.decode(await self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)


class PeerGone(Exception):
    """A ROUTER send to a peer that has disconnected: its requests should be abandoned, not finished."""


class FrameSocket:
    """Raw multipart frames for the RPC ROUTER (asyncio) side; the encoding lives in protocol/rpc.py."""

    def __init__(self, kind: int, addr: str, *, bind: bool, ctx: zmq.asyncio.Context | None = None,
                 key: ClusterKey | None = None):
        self.sock = _make(ctx or zmq.asyncio.Context.instance(), kind, addr, bind, key)
        if kind == ROUTER:
            # Without this a ROUTER silently drops frames for a peer that has gone, and a stream to a vanished
            # client would run to its end; with it the send raises, and the stream is aborted.
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)

    async def send(self, frames: list[bytes]) -> None:
        """Raises PeerGone if frames[0] (a ROUTER's peer identity) names a peer that has disconnected."""
        try:
            await self.sock.send_multipart(frames)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                raise PeerGone(frames[0].hex()) from e
            raise

    async def recv(self) -> tuple[list[bytes], str]:
        """(the frames, the sender's address: its IP on TCP)."""
        frames = await self.sock.recv_multipart(copy=False)
        return [frame.bytes for frame in frames], frames[0].get("Peer-Address")

    def close(self) -> None:
        self.sock.close(linger=0)


class BlockingFrameSocket:
    """Raw multipart frames for the RPC client (blocking) side."""

    def __init__(self, kind: int, addr: str, *, bind: bool, key: ClusterKey | None = None):
        self.sock = _make(zmq.Context.instance(), kind, addr, bind, key)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout_ms: int | None = None) -> list[bytes] | None:
        if timeout_ms is not None and not self.sock.poll(timeout_ms, zmq.POLLIN):
            return None
        return self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close(linger=0)
