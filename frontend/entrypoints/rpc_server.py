"""RpcServer: the internal RPC endpoint (--rpc-addr), serving protocol structs over a ZeroMQ ROUTER socket.

Wire format, keys, streaming and abort: protocol/rpc.py.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

import msgspec
from loraplex.frontend.adapters.audit import Caller
from loraplex.frontend.caller import set_caller_key
from loraplex.frontend.generate import GenerateService, raise_failure
from loraplex.frontend.params import NativeGenerateRequest, convert
from loraplex.frontend.request_state import RequestState
from loraplex.protocol import rpc
from loraplex.protocol.curve import ClusterKey
from loraplex.protocol.errors import ServerError
from loraplex.protocol.sockets import ROUTER, FrameSocket, PeerGone
from loraplex.protocol.structs import (
    AbortReqInput,
    GenerateReqInput,
    GenerateReqOutput,
    ListLoRAAdaptersReqInput,
    ListLoRAAdaptersReqOutput,
    LoadLoRAAdapterFromTensorsReqInput,
    LoadLoRAAdapterReqInput,
    RpcError,
    UnloadLoRAAdapterReqInput,
)

logger = logging.getLogger("loraplex.rpc")


class RpcServer:
    def __init__(self, service: GenerateService, addr: str):
        """service: the Runtime's one GenerateService (the HTTP app's), so both ways in share its requests."""
        self.service = service
        self.runtime = runtime = service.runtime
        self.addr = addr
        # a TCP address beyond loopback has the cluster key (config): CURVE, and only its holders get through
        self.sock = FrameSocket(ROUTER, addr, bind=True, key=ClusterKey.of(runtime.config.cluster_key_file))
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
            frames, peer = await self.sock.recv()
            if len(frames) < 3 or len(frames[1]) > rpc.MAX_REQUEST_ID_BYTES:
                if len(frames) >= 2:
                    await self._reply(frames[0], b"", RpcError(error_message="expected 2 frames (request id, "
                                      "payload), then a tensors request's tensor frames"))
                continue
            identity, request_id, payload, *tensor_frames = frames
            task = asyncio.create_task(self._answer(identity, request_id, payload, tensor_frames, f"rpc:{peer}"))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _reply(self, identity: bytes, request_id: bytes, reply: msgspec.Struct) -> None:
        try:
            await self.sock.send([identity, request_id, rpc.encode(reply)])
        except PeerGone:
            logger.info("RPC client left before its reply")

    async def _answer(self, identity: bytes, request_id: bytes, payload: bytes, tensor_frames: list[bytes],
                      client: str) -> None:
        request, api_key = rpc.decode_request(payload)
        # Whose request this is (rate limits, fair share); one task per request, so it stays this request's. Nothing
        # runs below unless the key checks out.
        set_caller_key(api_key if self.runtime.config.api_key else None)
        caller = Caller.presenting(client, api_key)
        try:
            if isinstance(request, RpcError):
                reply = request
            elif not self._authorized(request, api_key):
                if rpc.is_adapter_change(request):
                    self._audit_refusal(request, caller)
                reply = RpcError(error_message="missing or invalid API key")
            elif isinstance(request, LoadLoRAAdapterFromTensorsReqInput):
                reply = await self.service.load_adapter_from_tensors(request, tensor_frames, caller)
            elif tensor_frames:
                reply = RpcError(error_message=f"{type(request).__name__} takes 2 frames, got "
                                 f"{2 + len(tensor_frames)}")
            elif isinstance(request, GenerateReqInput) and request.stream:
                await self._stream(identity, request_id, request)
                return
            else:
                reply = await self._dispatch(request, caller)
        except PeerGone:
            logger.info("RPC client left mid-stream: its request was aborted")
            return
        except ServerError as e:
            reply = RpcError(error_message=str(e))
        except Exception as e:  # noqa: BLE001 - every failure becomes an RpcError reply, never a silent drop
            reply = RpcError(error_message=f"{type(e).__name__}: {e}")
        await self._reply(identity, request_id, reply)

    def _authorized(self, request: msgspec.Struct, api_key: str | None) -> bool:
        config = self.runtime.config
        key = config.admin_api_key if rpc.is_adapter_change(request) and config.admin_api_key else config.api_key
        return key is None or hmac.compare_digest((api_key or "").encode(), key.encode())

    def _audit_refusal(self, request: msgspec.Struct, caller: Caller) -> None:
        if isinstance(request, UnloadLoRAAdapterReqInput):
            self.runtime.audit.record("unload", list(request.lora_names), [], caller, "unauthorized")
        elif isinstance(request, LoadLoRAAdapterReqInput):
            self.runtime.audit.record("reload" if request.load_inplace else "load",
                                      [a.lora_name for a in request.adapters], [a.lora_path for a in request.adapters],
                                      caller, "unauthorized")
        else:  # from tensors
            self.runtime.audit.record("reload" if request.load_inplace else "load", [request.lora_name], [None],
                                      caller, "unauthorized")

    async def _dispatch(self, request: msgspec.Struct, caller: Caller) -> msgspec.Struct:
        if isinstance(request, LoadLoRAAdapterReqInput):
            return await self.service.load_adapters(request.adapters, request.load_inplace, caller=caller)
        if isinstance(request, UnloadLoRAAdapterReqInput):
            return await self.service.unload_adapters(request.lora_names, caller=caller)
        if isinstance(request, ListLoRAAdaptersReqInput):
            return ListLoRAAdaptersReqOutput(adapters=self.runtime.registry.table())
        if isinstance(request, AbortReqInput):
            return await self.service.abort(request.rid)
        if isinstance(request, GenerateReqInput):
            states, batched = await self.service.start(generate_body(request))
            try:
                outputs = await self.service.collect(states, batched)
            finally:
                await self.service.finish(states)
            return GenerateReqOutput(outputs=outputs if batched else [outputs])
        return RpcError(error_message=f"unsupported request {type(request).__name__}")

    async def _stream(self, identity: bytes, request_id: bytes, request: GenerateReqInput) -> None:
        """Chunks of what is new, then the last one (finished=True); raises PeerGone if the client has left."""
        states, _ = await self.service.start(generate_body(request))
        deltas = StreamDeltas(states)
        try:
            async for index, state in self.service.stream(states):
                if state.error or all(s.finished for s in states):
                    break  # the last chunk (or the RpcError) is sent below
                item = deltas.take(index)
                if item is not None:
                    chunk = GenerateReqOutput(outputs=[item], finished=False)
                    await self.sock.send([identity, request_id, rpc.encode(chunk)])
            raise_failure(states)
            last = [item for i in range(len(states)) if (item := deltas.take(i)) is not None]
            await self.sock.send([identity, request_id, rpc.encode(GenerateReqOutput(outputs=last))])
        finally:  # every path, a client gone included: frees the requests (and aborts the unfinished ones)
            await self.service.finish(states)


def generate_body(request: GenerateReqInput) -> NativeGenerateRequest:
    raw = {f: getattr(request, f) for f in request.__struct_fields__ if getattr(request, f) is not None}
    return convert(raw, NativeGenerateRequest, "generate request")


class StreamDeltas:
    """What each prompt of a stream has not been sent yet: text and token ids past the sent offsets, its finish."""

    def __init__(self, states: list[RequestState]):
        self.states = states
        self.text_lens = [0] * len(states)
        self.num_ids = [0] * len(states)
        self.num_input_logprobs = [0] * len(states)
        self.is_done = [False] * len(states)

    def take(self, index: int) -> dict | None:
        """The item for prompt `index` with everything new since the last take, or None if nothing is."""
        state = self.states[index]
        text = state.text[self.text_lens[index] :]
        output_ids = state.output_ids[self.num_ids[index] :]
        if not text and not output_ids and (self.is_done[index] or not state.finished):
            return None
        first, first_input = self.num_ids[index], self.num_input_logprobs[index]
        self.text_lens[index] += len(text)
        self.num_ids[index] += len(output_ids)
        self.num_input_logprobs[index] = state.num_prompt_logprob_entries
        self.is_done[index] = state.finished
        return {"index": index, "text": text, "output_ids": output_ids,
                "meta_info": state.meta_info(first, first_input)}
