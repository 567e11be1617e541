"""The internal RPC wire format, so that a service in any language can speak it.

Transport: a ZeroMQ ROUTER socket at the server's `--rpc-addr`; clients connect a DEALER socket (which adds and strips
the routing identity, so a client sees exactly the frames below).

Request: two frames, `[request_id, payload]` (a LoadLoRAAdapterFromTensorsReqInput: more, see Tensors below).
  - request_id: any bytes (at most 64) chosen by the client; every reply to the request carries it back, so requests
    may be pipelined and streams interleaved on one socket. Use a fresh id per request.
  - payload: MessagePack of one request struct as a map with a "type" key naming it, its fields beside it
    (protocol/structs.py; omitted fields take their defaults, unknown keys are ignored), and the caller's key:
    {"type": "LoadLoRAAdapterReqInput", "adapters": [{"lora_name": "a", "lora_path": "/p", "pinned": false}],
     "load_inplace": false, "api_key": "secret"}
    Request types: GenerateReqInput, AbortReqInput, LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput,
    ListLoRAAdaptersReqInput, LoadLoRAAdapterFromTensorsReqInput.

Tensors: LoadLoRAAdapterFromTensorsReqInput {"lora_name", "config_dict": adapter_config.json's content as a map,
"tensors": [[name, dtype, shape], ...], "pinned": bool or nil, "load_inplace": bool} is followed by one frame per
entry of "tensors", in that order: `[request_id, payload, tensor_0, tensor_1, ...]`. A tensor frame holds exactly
the tensor's raw bytes, C order, little-endian; dtype is "float32", "float16", "bfloat16" or "float64"; names and
shapes are PEFT's (adapter_model.safetensors: `...layers.N.self_attn.q_proj.lora_A.weight` is (r, in), `lora_B`
(out, r)). Nothing is pickled. The reply is a LoadLoRAAdapterReqOutput; a frame count that differs from the tensors
list, a frame of the wrong size, a wrong shape, a missing lora_A/lora_B or an unknown module fails the load (a
result with success false), as a directory load would. Any other request with more than two frames gets an RpcError.

Keys: "api_key" is a string; absent or nil = no key. A server started with `--api-key` answers a request whose key
is missing or wrong with an RpcError and does nothing else. Adapter changes (ADAPTER_CHANGE_TYPES) need
`--admin-api-key` instead when the server has one; everything else needs `--api-key`. Keys compare in constant time.

Reply: two frames, `[request_id, payload]`, payload one of
  - GenerateReqOutput {"outputs": [...], "success", "error_message", "finished"}: one /generate response object per
    prompt ({"text", "output_ids", "meta_info": {"id", "prompt_tokens", "completion_tokens", "finish_reason"}});
  - AbortReqOutput {"success", "rid", "message"}: success false when no request with that rid was in flight;
  - LoadLoRAAdapterReqOutput, UnloadLoRAAdapterReqOutput: per-adapter failures are results, not RpcErrors;
  - ListLoRAAdaptersReqOutput;
  - RpcError {"type": "RpcError", "error_message": ...}: a frame that does not decode, a missing or wrong key, or a
    request that fails as a whole (a disabled adapter change, an unknown adapter, a failed generation, ...).
A message of fewer than two frames gets an RpcError with an empty request_id.

Streaming: a GenerateReqInput with "stream": true gets several replies with its request_id: GenerateReqOutput chunks
with "finished": false, then one with "finished": true, which ends the stream. Instead of that last chunk the stream
may end with an RpcError (the generation failed; every prompt of the request is then stopped). A chunk's "outputs"
holds only the prompts that changed, each {"index": position of the prompt in the request (0 if not batched),
"text": the text new since the previous chunk of that index, "output_ids": the token ids new since then,
"meta_info": as above, counted so far}: the concatenated "text" and "output_ids" of an index equal the non-streamed
output. A prompt's last item has meta_info.finish_reason set; the "finished": true chunk holds the last items.

Abort: AbortReqInput {"rid"} stops the request with that rid (give it in GenerateReqInput's "rid" to abort it later;
any client may abort it). A streamed request so stopped ends at once with its last chunk, finish_reason
{"type": "abort", ...}; a non-streamed one returns what it had generated, with the same finish_reason.
A client that disconnects mid-stream has its request aborted at the next chunk.
"""

from __future__ import annotations

from typing import Any

import msgspec
from loraplex.protocol.structs import RpcError, RpcReply, RpcRequest

MAX_REQUEST_ID_BYTES = 64
API_KEY_FIELD = "api_key"
# Requests that need --admin-api-key when the server has one (the HTTP load/unload routes' rule).
ADAPTER_CHANGE_TYPES = frozenset({"LoadLoRAAdapterReqInput", "UnloadLoRAAdapterReqInput",
                                  "LoadLoRAAdapterFromTensorsReqInput"})


class _Credentials(msgspec.Struct):
    """The key beside a request's fields; decoding ignores every other key of the map."""

    api_key: str | None = None


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(RpcRequest)
_credentials_decoder = msgspec.msgpack.Decoder(_Credentials)
_reply_decoder = msgspec.msgpack.Decoder(RpcReply)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def encode_request(msg: msgspec.Struct, api_key: str | None = None) -> bytes:
    if api_key is None:
        return _encoder.encode(msg)
    config = msg.__struct_config__
    assert API_KEY_FIELD not in msg.__struct_fields__, type(msg).__name__
    return _encoder.encode({config.tag_field: config.tag, **msgspec.structs.asdict(msg), API_KEY_FIELD: api_key})


def decode_request(payload: bytes) -> tuple[Any, str | None]:
    """(the request struct, its api_key), or (an RpcError describing why the frame is not one, None)."""
    try:
        return _request_decoder.decode(payload), _credentials_decoder.decode(payload).api_key
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return RpcError(error_message=f"bad RPC request: {e}"), None


def is_adapter_change(request: msgspec.Struct) -> bool:
    return type(request).__name__ in ADAPTER_CHANGE_TYPES


def decode_reply(payload: bytes) -> Any:
    return _reply_decoder.decode(payload)
