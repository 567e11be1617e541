"""RpcServer: the internal RPC endpoint (--rpc-addr), serving protocol structs over a ZeroMQ ROUTER socket."""

from __future__ import annotations

import asyncio
import logging

import msgspec

from frontend.native_api import NativeGenerateRequest, collect, start_generate
from frontend.params import convert
from frontend.runtime import Runtime
from protocol import rpc
from protocol.sockets import ROUTER, FrameSocket
from protocol.structs import (
    GenerateReqInput,
    GenerateReqOutput,
    ListLoRAAdaptersReqInput,
    ListLoRAAdaptersReqOutput,
    LoadLoRAAdapterReqInput,
    RpcError,
    UnloadLoRAAdapterReqInput,
)

logger = logging.getLogger("loraplex.rpc")


class RpcServer:
    def __init__(self, runtime: Runtime, addr: str):
        self.runtime = runtime
        self.addr = addr
        self.sock = FrameSocket(ROUTER, addr, bind=True)
        self._task: asyncio.Task | None = None
        self._handlers: set[asyncio.Task] = set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())
        logger.info("RPC listening on %s", self.addr)

    def stop(self) -> None:
        for task in [self._task, *self._handlers]:
            if task is not None:
                task.cancel()
        self.sock.close()

    async def _serve(self) -> None:
        while True:
            frames = await self.sock.recv()
            if len(frames) != 3 or len(frames[1]) > rpc.MAX_REQUEST_ID_BYTES:
                if len(frames) >= 2:
                    await self.sock.send([frames[0], b"", rpc.encode(RpcError(error_message="expected 2 frames"))])
                continue
            identity, request_id, payload = frames
            task = asyncio.create_task(self._answer(identity, request_id, payload))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _answer(self, identity: bytes, request_id: bytes, payload: bytes) -> None:
        request = rpc.decode_request(payload)
        try:
            reply = request if isinstance(request, RpcError) else await self._dispatch(request)
        except Exception as e:  # noqa: BLE001 - every failure becomes an RpcError reply, never a silent drop
            reply = RpcError(error_message=f"{type(e).__name__}: {e}")
        await self.sock.send([identity, request_id, rpc.encode(reply)])

    async def _dispatch(self, request: msgspec.Struct) -> msgspec.Struct:
        runtime = self.runtime
        runtime.check_available()
        if isinstance(request, LoadLoRAAdapterReqInput):
            return await runtime.adapters.load(request.adapters, request.load_inplace)
        if isinstance(request, UnloadLoRAAdapterReqInput):
            return await runtime.adapters.unload(request.lora_names)
        if isinstance(request, ListLoRAAdaptersReqInput):
            return ListLoRAAdaptersReqOutput(adapters=runtime.registry.table())
        if isinstance(request, GenerateReqInput):
            raw = {f: getattr(request, f) for f in request.__struct_fields__ if getattr(request, f) is not None}
            body = convert(raw, NativeGenerateRequest, "generate request")
            states, batched = await start_generate(runtime, body)
            try:
                outputs = await collect(runtime, states, batched)
            finally:
                for state in states:
                    await runtime.finish(state)
            return GenerateReqOutput(outputs=outputs if batched else [outputs])
        return RpcError(error_message=f"unsupported request {type(request).__name__}")
