"""The internal RPC wire format, so that a service in any language can speak it.

Transport: a ZeroMQ ROUTER socket at the server's `--rpc-addr`; clients connect a DEALER socket.
Request: two frames, `[request_id, payload]`.
  - request_id: any bytes (at most 64) chosen by the client; the reply carries it back, so requests may be pipelined.
  - payload: MessagePack of one request struct as a map with a "type" key naming it, e.g.
    {"type": "LoadLoRAAdapterReqInput", "adapters": [{"lora_name": "a", "lora_path": "/p", "pinned": false}],
     "load_inplace": false}
    Request types: GenerateReqInput, LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput, ListLoRAAdaptersReqInput
    (fields as in protocol/structs.py; omitted fields take their defaults).
Reply: two frames, `[request_id, payload]`, payload one of GenerateReqOutput, LoadLoRAAdapterReqOutput,
UnloadLoRAAdapterReqOutput, ListLoRAAdaptersReqOutput, or RpcError {"type": "RpcError", "error_message": ...}
for a frame that does not decode or a request that fails as a whole. Per-adapter failures are results, not RpcErrors.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.structs import RpcError, RpcReply, RpcRequest

MAX_REQUEST_ID_BYTES = 64

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(RpcRequest)
_reply_decoder = msgspec.msgpack.Decoder(RpcReply)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_request(payload: bytes) -> Any:
    """The request struct, or an RpcError describing why the frame is not one."""
    try:
        return _request_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return RpcError(error_message=f"bad RPC request: {e}")


def decode_reply(payload: bytes) -> Any:
    return _reply_decoder.decode(payload)
