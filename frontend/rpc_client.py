"""RpcClient: call a loraplex server's internal RPC endpoint (--rpc-addr) from Python. Wire format: protocol/rpc.py."""

from __future__ import annotations

import itertools
import os
from typing import Any

from protocol import rpc
from protocol.sockets import DEALER, BlockingFrameSocket
from protocol.structs import (
    GenerateReqInput,
    GenerateReqOutput,
    ListLoRAAdaptersReqInput,
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
    def __init__(self, addr: str, timeout_s: float = 300.0):
        self.sock = BlockingFrameSocket(DEALER, addr, bind=False)
        self.timeout_s = timeout_s
        self._ids = itertools.count()
        self._prefix = os.urandom(4).hex()

    def call(self, request: Any) -> Any:
        request_id = f"{self._prefix}-{next(self._ids)}".encode()
        self.sock.send([request_id, rpc.encode(request)])
        while True:
            frames = self.sock.recv(timeout_ms=int(self.timeout_s * 1000))
            if frames is None:
                raise TimeoutError(f"no RPC reply within {self.timeout_s:g} s")
            if frames[0] == request_id:  # replies to timed-out earlier calls are dropped
                break
        reply = rpc.decode_reply(frames[1])
        if isinstance(reply, RpcError):
            raise RpcCallError(reply.error_message)
        return reply

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False,
                          load_inplace: bool = False) -> LoadLoRAAdapterReqOutput:
        spec = LoRAAdapterSpec(lora_name=lora_name, lora_path=lora_path, pinned=pinned)
        return self.call(LoadLoRAAdapterReqInput(adapters=[spec], load_inplace=load_inplace))

    def load_lora_adapters(self, specs: list[LoRAAdapterSpec]) -> LoadLoRAAdapterReqOutput:
        return self.call(LoadLoRAAdapterReqInput(adapters=specs))

    def unload_lora_adapter(self, *lora_names: str) -> UnloadLoRAAdapterReqOutput:
        return self.call(UnloadLoRAAdapterReqInput(lora_names=list(lora_names)))

    def list_lora_adapters(self) -> list[dict]:
        return self.call(ListLoRAAdaptersReqInput()).adapters

    def generate(self, text: str | list[str] | None = None, sampling_params: dict | None = None,
                 lora_path: Any = None, input_ids: Any = None) -> list[dict]:
        req = GenerateReqInput(text=text, input_ids=input_ids, sampling_params=sampling_params, lora_path=lora_path)
        result: GenerateReqOutput = self.call(req)
        return result.outputs

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
