"""RpcClient: call a loraplex server's internal RPC endpoint (--rpc-addr) from Python. Wire format: protocol/rpc.py."""

from __future__ import annotations

import itertools
import os
import uuid
from collections import deque
from collections.abc import Iterator
from typing import Any

from loraplex.protocol import rpc
from loraplex.protocol.curve import ClusterKey
from loraplex.protocol.sockets import DEALER, BlockingFrameSocket
from loraplex.protocol.structs import (
    AbortReqInput,
    AbortReqOutput,
    GenerateReqInput,
    GenerateReqOutput,
    ListLoRAAdaptersReqInput,
    LoadLoRAAdapterFromTensorsReqInput,
    LoadLoRAAdapterReqInput,
    LoadLoRAAdapterReqOutput,
    LoRAAdapterSpec,
    RpcError,
    UnloadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqOutput,
)


class RpcCallError(RuntimeError):
    pass


class RpcClient:
    """Blocking, one thread at a time. `api_key` travels with every request (the server's --api-key, or its
    --admin-api-key for adapter loads and unloads). `cluster_key_file`: the server's --cluster-key-file, needed on a
    TCP address when the server has one (CURVE: without it the server refuses the connection, and calls time out)."""

    def __init__(self, addr: str, api_key: str | None = None, timeout_s: float = 300.0,
                 cluster_key_file: str | None = None):
        self.sock = BlockingFrameSocket(DEALER, addr, bind=False, key=ClusterKey.of(cluster_key_file))
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._ids = itertools.count()
        self._prefix = os.urandom(4).hex()
        # request_id -> replies read while waiting for another request's; only open streams keep theirs
        self._buffered: dict[bytes, deque[bytes]] = {}

    def call(self, request: Any) -> Any:
        return self._recv(self._send(request))

    def _send(self, request: Any, tensor_frames: list[Any] = ()) -> bytes:
        request_id = f"{self._prefix}-{next(self._ids)}".encode()
        self.sock.send([request_id, rpc.encode_request(request, self.api_key), *tensor_frames])
        return request_id

    def _recv(self, request_id: bytes) -> Any:
        buffered = self._buffered.get(request_id)
        if buffered:
            payload = buffered.popleft()
        else:
            while True:
                frames = self.sock.recv(timeout_ms=int(self.timeout_s * 1000))
                if frames is None:
                    raise TimeoutError(f"no RPC reply within {self.timeout_s:g} s")
                if frames[0] == request_id:
                    payload = frames[1]
                    break
                if frames[0] in self._buffered:
                    self._buffered[frames[0]].append(frames[1])
                # else: a reply to a timed-out call or to a stream its caller left: dropped
        reply = rpc.decode_reply(payload)
        if isinstance(reply, RpcError):
            raise RpcCallError(reply.error_message)
        return reply

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False,
                          load_inplace: bool = False) -> LoadLoRAAdapterReqOutput:
        spec = LoRAAdapterSpec(lora_name=lora_name, lora_path=lora_path, pinned=pinned)
        return self.call(LoadLoRAAdapterReqInput(adapters=[spec], load_inplace=load_inplace))

    def load_lora_adapters(self, specs: list[LoRAAdapterSpec]) -> LoadLoRAAdapterReqOutput:
        return self.call(LoadLoRAAdapterReqInput(adapters=specs))

    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: dict[str, Any], config_dict: dict,
                                       pinned: bool | None = None,
                                       load_inplace: bool = False) -> LoadLoRAAdapterReqOutput:
        """torch tensors named as in adapter_model.safetensors, and adapter_config.json's content: each tensor's
        bytes go as one frame after the payload."""
        from loraplex.frontend.adapters.files import encode_tensors

        specs, buffers = encode_tensors(tensors)
        request = LoadLoRAAdapterFromTensorsReqInput(lora_name=lora_name, config_dict=config_dict, tensors=specs,
                                                     pinned=pinned, load_inplace=load_inplace)
        return self._recv(self._send(request, buffers))

    def unload_lora_adapter(self, *lora_names: str) -> UnloadLoRAAdapterReqOutput:
        return self.call(UnloadLoRAAdapterReqInput(lora_names=list(lora_names)))

    def list_lora_adapters(self) -> list[dict]:
        return self.call(ListLoRAAdaptersReqInput()).adapters

    def generate(self, text: str | list[str] | None = None, sampling_params: dict | None = None,
                 lora_path: Any = None, input_ids: Any = None, rid: str | list[str] | None = None,
                 **logprob_options: Any) -> list[dict]:
        """logprob_options: return_logprob, top_logprobs_num, logprob_start_len, return_text_in_logprobs, lora_scale
        (the GenerateReqInput fields, as /generate takes them); lora_path: an adapter name or a lora_mix dict."""
        req = GenerateReqInput(text=text, input_ids=input_ids, sampling_params=sampling_params, lora_path=lora_path,
                               rid=rid, **logprob_options)
        result: GenerateReqOutput = self.call(req)
        return result.outputs

    def generate_stream(self, text: str | list[str] | None = None, sampling_params: dict | None = None,
                        lora_path: Any = None, input_ids: Any = None,
                        rid: str | list[str] | None = None, **logprob_options: Any) -> Iterator[GenerateReqOutput]:
        """Yields the stream's chunks (items with "index" and the text and output_ids new since the index's last
        item), the last with finished=True. Leaving early (break, close, an error) aborts the request on the
        server, so give `rid` only if it must be known elsewhere (one per prompt when batched)."""
        if rid is None:
            num_prompts = batch_size(text, input_ids)
            rid = uuid.uuid4().hex if num_prompts is None else [uuid.uuid4().hex for _ in range(num_prompts)]
        req = GenerateReqInput(text=text, input_ids=input_ids, sampling_params=sampling_params, lora_path=lora_path,
                               rid=rid, stream=True, **logprob_options)
        request_id = self._send(req)
        self._buffered[request_id] = deque()
        is_finished = False
        try:
            while not is_finished:
                chunk: GenerateReqOutput = self._recv(request_id)
                is_finished = chunk.finished
                yield chunk
        finally:
            del self._buffered[request_id]
            if not is_finished:  # the server may still be generating: stop it (the replies are dropped)
                for one_rid in [rid] if isinstance(rid, str) else rid:
                    self._send(AbortReqInput(rid=one_rid))

    def abort(self, rid: str) -> AbortReqOutput:
        return self.call(AbortReqInput(rid=rid))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def batch_size(text: str | list[str] | None, input_ids: Any) -> int | None:
    """The number of prompts of a batched generate request; None if it is not batched."""
    if isinstance(text, list):
        return len(text)
    if isinstance(input_ids, list) and input_ids and all(isinstance(t, list) for t in input_ids):
        return len(input_ids)
    return None
