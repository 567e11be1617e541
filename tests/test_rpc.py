"""The internal RPC endpoint: the same protocol structs as the processes exchange, over ZeroMQ."""

from __future__ import annotations

import msgspec
import pytest

from frontend.rpc_client import RpcCallError, RpcClient
from protocol import rpc
from protocol.sockets import DEALER, BlockingFrameSocket
from protocol.structs import LoadLoRAAdapterReqInput, LoRAAdapterSpec, RpcError
from tests.server_utils import ServerProcess


def test_rpc_load_generate_unload(llama_dir, adapter_dirs, tmp_path):
    addr = f"ipc://{tmp_path}/rpc.sock"
    with ServerProcess("--model-path", str(llama_dir), "--enable-lora", "--max-lora-rank", "64",
                       "--lora-target-modules", "all", "--rpc-addr", addr, "--max-total-tokens", "4096") as server, \
            RpcClient(addr, timeout_s=60) as client:
        out = client.load_lora_adapter("r8", str(adapter_dirs["a8"]))
        assert out.success and out.loaded_adapters == {"r8": str(adapter_dirs["a8"])}
        bad = client.load_lora_adapter("r8", str(adapter_dirs["a4"]))
        assert not bad.success and "has already been loaded" in bad.results[0].error_message
        batch = client.load_lora_adapters([LoRAAdapterSpec(lora_name="m", lora_path=str(tmp_path / "missing")),
                                           LoRAAdapterSpec(lora_name="r4", lora_path=str(adapter_dirs["a4"]))])
        assert [r.success for r in batch.results] == [False, True]
        assert [a["lora_name"] for a in client.list_lora_adapters()] == ["r8", "r4"]
        params = {"max_new_tokens": 8, "temperature": 0}
        outputs = client.generate("Once upon", params, lora_path="r8")
        http = server.post("/generate", {"text": "Once upon", "lora_path": "r8", "sampling_params": params}).json()
        assert outputs[0]["output_ids"] == http["output_ids"]
        assert len(client.generate(["a", "b"], params, lora_path=["r4", None])) == 2
        with pytest.raises(RpcCallError, match="nope"):
            client.generate("x", params, lora_path="nope")
        assert client.unload_lora_adapter("r8", "r4").success
        assert client.list_lora_adapters() == []
        # a frame that is not a protocol struct gets an RpcError, and the endpoint keeps serving
        sock = BlockingFrameSocket(DEALER, addr, bind=False)
        try:
            sock.send([b"id-1", b"\xc1 not msgpack"])
            request_id, payload = sock.recv(timeout_ms=10_000)
            assert request_id == b"id-1" and isinstance(rpc.decode_reply(payload), RpcError)
            sock.send([b"id-2", msgspec.msgpack.encode({"type": "LoadLoRAAdapterReqInput", "adapters": "x"})])
            assert isinstance(rpc.decode_reply(sock.recv(timeout_ms=10_000)[1]), RpcError)
            sock.send([b"id-3", rpc.encode(LoadLoRAAdapterReqInput(adapters=[]))])
            assert not isinstance(rpc.decode_reply(sock.recv(timeout_ms=10_000)[1]), RpcError)
        finally:
            sock.close()
        assert server.get("/health").status_code == 200
