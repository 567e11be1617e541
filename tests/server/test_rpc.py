"""The internal RPC endpoint: the same protocol structs as the processes exchange, over ZeroMQ."""

from __future__ import annotations

import asyncio
import re
import time
from types import SimpleNamespace

import msgspec
import pytest
from loraplex.frontend.entrypoints.cli import config_from_args
from loraplex.frontend.entrypoints.rpc_client import RpcCallError, RpcClient
from loraplex.frontend.entrypoints.rpc_server import RpcServer
from loraplex.protocol import rpc
from loraplex.protocol.config import ConfigError, ServerConfig
from loraplex.protocol.errors import ServerError
from loraplex.protocol.sockets import DEALER, BlockingFrameSocket
from loraplex.protocol.structs import (
    AbortReqInput,
    AbortReqOutput,
    GenerateReqInput,
    GenerateReqOutput,
    ListLoRAAdaptersReqOutput,
    LoadLoRAAdapterReqInput,
    LoRAAdapterSpec,
    RpcError,
)

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


# ---- keys, streaming, abort: one server with --api-key and --admin-api-key -------------------------------

KEY, ADMIN_KEY = "user-key", "admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}  # far longer than any abort takes


@pytest.fixture(scope="module")
def keyed_server(llama_dir, adapter_dirs, tmp_path_factory):
    addr = f"ipc://{tmp_path_factory.mktemp('rpc')}/rpc.sock"
    with ServerProcess("--model-path", str(llama_dir), "--enable-lora", "--max-lora-rank", "64",
                       "--lora-target-modules", "all", "--rpc-addr", addr, "--max-total-tokens", "4096",
                       "--api-key", KEY, "--admin-api-key", ADMIN_KEY) as server:
        with RpcClient(addr, api_key=ADMIN_KEY, timeout_s=60) as admin:
            assert admin.load_lora_adapter("r4", str(adapter_dirs["a4"])).success
        yield server, addr


def assert_no_leaks(server: ServerProcess) -> None:
    """Aborts and finishes land a moment after the replies: wait for the counters, then assert them."""
    deadline = time.monotonic() + 20
    while True:
        info = server.get("/server_info", headers=AUTH).json()
        counts = info["num_requests_in_flight"], info["num_adapter_holds"]
        if counts == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert counts == (0, 0), f"leaked (requests in flight, adapter holds): {counts}"


def generation_tokens(server: ServerProcess) -> float:
    """Tokens generated by finished requests (a request's count lands when it is freed)."""
    text = server.get("/metrics", headers=AUTH).text
    return float(re.search(r"^loraplex_generation_tokens_total (\S+)$", text, re.M).group(1))


def test_rpc_keys(keyed_server, adapter_dirs):
    server, addr = keyed_server
    path = str(adapter_dirs["a8"])
    params = {"max_new_tokens": 4, "temperature": 0}
    user, admin, anon, wrong = (RpcClient(addr, api_key=k, timeout_s=60) for k in (KEY, ADMIN_KEY, None, "wrong"))
    with user, admin, anon, wrong:
        for client in (anon, wrong):
            with pytest.raises(RpcCallError, match="API key"):
                client.generate("hi", params)
            with pytest.raises(RpcCallError, match="API key"):
                next(client.generate_stream("hi", params))
            with pytest.raises(RpcCallError, match="API key"):
                client.list_lora_adapters()
            with pytest.raises(RpcCallError, match="API key"):
                client.load_lora_adapter("r8", path)
            with pytest.raises(RpcCallError, match="API key"):
                client.unload_lora_adapter("r4")
            with pytest.raises(RpcCallError, match="API key"):
                client.abort("any")
        # --admin-api-key set: adapter changes take it and only it; everything else takes --api-key
        with pytest.raises(RpcCallError, match="API key"):
            user.load_lora_adapter("r8", path)
        with pytest.raises(RpcCallError, match="API key"):
            user.unload_lora_adapter("r4")
        with pytest.raises(RpcCallError, match="API key"):
            admin.generate("hi", params)
        # nothing changed
        assert [a["lora_name"] for a in user.list_lora_adapters()] == ["r4"]
        assert [a["lora_name"] for a in server.get("/lora_adapters", headers=AUTH).json()["adapters"]] == ["r4"]
        assert admin.load_lora_adapter("r8", path).success
        assert len(user.generate("hi", params, lora_path="r8")[0]["output_ids"]) == 4
        assert admin.unload_lora_adapter("r8").success
        assert [a["lora_name"] for a in user.list_lora_adapters()] == ["r4"]
    # the key as the wire carries it: a string field of the request map, beside the tag and the struct's fields
    sock = BlockingFrameSocket(DEALER, addr, bind=False)
    try:
        for api_key, ok in [(KEY, True), (None, False), (5, False), (KEY + "x", False), (ADMIN_KEY, False)]:
            request = {"type": "ListLoRAAdaptersReqInput"} | ({} if api_key is None else {"api_key": api_key})
            sock.send([b"k", msgspec.msgpack.encode(request)])
            reply = rpc.decode_reply(sock.recv(timeout_ms=10_000)[1])
            assert isinstance(reply, ListLoRAAdaptersReqOutput) if ok else isinstance(reply, RpcError), api_key
    finally:
        sock.close()
    assert_no_leaks(server)


def joined(chunks: list[GenerateReqOutput], index: int) -> tuple[str, list[int], dict]:
    """A streamed prompt's text and ids put back together, and its last meta_info."""
    items = [item for chunk in chunks for item in chunk.outputs if item["index"] == index]
    return "".join(i["text"] for i in items), [t for i in items for t in i["output_ids"]], items[-1]["meta_info"]


def test_rpc_stream_matches_generate(keyed_server):
    server, addr = keyed_server
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with RpcClient(addr, api_key=KEY, timeout_s=60) as client:
        whole = client.generate("Once upon", params, lora_path="r4")[0]
        chunks = list(client.generate_stream("Once upon", params, lora_path="r4"))
        assert len(chunks) > 1
        assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
        text, output_ids, meta = joined(chunks, 0)
        assert (text, output_ids) == (whole["text"], whole["output_ids"]) and len(output_ids) == 12
        assert meta["finish_reason"] == whole["meta_info"]["finish_reason"] == {"type": "length", "length": 12}

        prompts, adapters = ["Once upon", "The cat sat"], ["r4", None]
        wholes = client.generate(prompts, params, lora_path=adapters)
        chunks = list(client.generate_stream(prompts, params, lora_path=adapters))
        assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
        for index, expected in enumerate(wholes):
            text, output_ids, meta = joined(chunks, index)
            assert (text, output_ids) == (expected["text"], expected["output_ids"])
            assert meta["finish_reason"]["type"] == "length"

        # a request that fails as a whole: an RpcError instead of chunks
        with pytest.raises(RpcCallError, match="nope"):
            next(client.generate_stream("x", params, lora_path="nope"))
        # a caller that leaves early aborts its request
        before = generation_tokens(server)
        stream = client.generate_stream("Once upon", LONG, lora_path="r4")
        assert not next(stream).finished
        stream.close()
        assert_no_leaks(server)
        assert generation_tokens(server) - before < LONG["max_new_tokens"]
    assert_no_leaks(server)


def test_rpc_abort_mid_stream(keyed_server):
    server, addr = keyed_server
    with RpcClient(addr, api_key=KEY, timeout_s=60) as client, RpcClient(addr, api_key=KEY, timeout_s=60) as other:
        missing = other.abort("nobody")
        assert (missing.success, missing.rid) == (False, "nobody") and "nobody" in missing.message
        chunks = []
        for chunk in client.generate_stream("Once upon", LONG, lora_path="r4", rid="to-abort"):
            chunks.append(chunk)
            if len(chunks) == 1:
                assert other.abort("to-abort") == AbortReqOutput(success=True, rid="to-abort")
        assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
        _, output_ids, meta = joined(chunks, 0)
        assert meta["finish_reason"]["type"] == "abort"
        assert meta["completion_tokens"] == len(output_ids) < LONG["max_new_tokens"]
        # a client may abort its own stream: the chunks that arrive meanwhile wait for the stream
        stream = client.generate_stream("The cat", LONG, rid="own")
        first = next(stream)
        assert client.abort("own").success
        chunks = [first, *stream]
        assert chunks[-1].finished and joined(chunks, 0)[2]["finish_reason"]["type"] == "abort"
        assert not other.abort("own").success  # over: nothing in flight any more
    assert_no_leaks(server)


def test_rpc_client_gone_mid_stream(keyed_server):
    server, addr = keyed_server
    before = generation_tokens(server)
    sock = BlockingFrameSocket(DEALER, addr, bind=False)
    try:
        request = GenerateReqInput(text="Once upon", sampling_params=LONG, lora_path="r4", stream=True)
        sock.send([b"gone", rpc.encode_request(request, KEY)])
        request_id, payload = sock.recv(timeout_ms=60_000)
        chunk = rpc.decode_reply(payload)
        assert request_id == b"gone" and isinstance(chunk, GenerateReqOutput) and not chunk.finished
    finally:
        sock.close()  # no abort: the server notices at its next chunk
    assert_no_leaks(server)
    assert generation_tokens(server) - before < LONG["max_new_tokens"]
    assert server.get("/health").status_code == 200


def test_rpc_api_key_rides_in_the_request_map():
    load = LoadLoRAAdapterReqInput(adapters=[LoRAAdapterSpec(lora_name="a", lora_path="/p")], load_inplace=True)
    for request in (load, GenerateReqInput(text="hi", stream=True), AbortReqInput(rid="r")):
        assert rpc.decode_request(rpc.encode_request(request, "k")) == (request, "k")
        assert rpc.decode_request(rpc.encode_request(request)) == (request, None)
    as_map = msgspec.msgpack.decode(rpc.encode_request(AbortReqInput(rid="r"), "k"))
    assert as_map == {"type": "AbortReqInput", "rid": "r", "api_key": "k"}
    bad = msgspec.msgpack.encode({"type": "AbortReqInput", "rid": "r", "api_key": 5})
    assert isinstance(rpc.decode_request(bad)[0], RpcError)
    assert rpc.is_adapter_change(load) and not rpc.is_adapter_change(AbortReqInput(rid="r"))


def test_rpc_server_error_is_an_rpc_error_with_its_message(tmp_path):
    """An adapter operation's ServerError (e.g. kind "disabled" under --disable-lora-updates) -> RpcError(str(e))."""

    class Adapters:
        async def load(self, specs, load_inplace, caller):
            raise ServerError("adapter updates are disabled (--disable-lora-updates)", "disabled")

    runtime = SimpleNamespace(config=ServerConfig(), adapters=Adapters())
    service = SimpleNamespace(runtime=runtime, load_adapters=runtime.adapters.load)
    addr = f"ipc://{tmp_path}/rpc.sock"

    async def main() -> None:
        server = RpcServer(service, addr)
        server.start()
        try:
            with RpcClient(addr, timeout_s=10) as client:
                with pytest.raises(RpcCallError) as info:
                    await asyncio.to_thread(client.load_lora_adapter, "a", "/p")
            assert str(info.value) == "adapter updates are disabled (--disable-lora-updates)"
        finally:
            server.stop()

    asyncio.run(main())


# ---- --rpc-addr: a non-loopback TCP address needs --api-key ------------------------------------------------


@pytest.mark.parametrize("addr", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555"])
def test_config_refuses_open_rpc_addr_without_key(addr):
    with pytest.raises(ConfigError, match="--api-key"):
        config_from_args(["--rpc-addr", addr])
    with pytest.raises(ConfigError, match="--api-key"):  # --admin-api-key alone does not count
        config_from_args(["--rpc-addr", addr, "--admin-api-key", "a"])
    assert config_from_args(["--rpc-addr", addr, "--api-key", "k", "--cluster-key-file", "/k"]).rpc_addr == addr


@pytest.mark.parametrize("addr", ["tcp://127.0.0.1:5555", "tcp://127.3.4.5:5555", "tcp://localhost:5555",
                                  "tcp://[::1]:5555", "ipc:///tmp/loraplex-rpc.sock"])
def test_config_takes_loopback_rpc_addr_without_key(addr):
    assert config_from_args(["--rpc-addr", addr]).rpc_addr == addr
