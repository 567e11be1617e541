"""Operators' controls on a running server, through the native API, the OpenAI-style API and the RPC: updates closed
by default beyond loopback, the audit trail, base-model and manifest refusals, and CURVE on a TCP --rpc-addr."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from loraplex.frontend.entrypoints.rpc_client import RpcCallError, RpcClient
from loraplex.protocol.curve import write_key_file

from tests.manifests import write_manifest
from tests.net import free_port
from tests.relay import Relay
from tests.server_utils import ServerProcess

GREEDY = {"max_new_tokens": 6, "temperature": 0}
KEY = "sk-operator"
LORA = ("--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all", "--max-total-tokens", "2048",
        "--context-length", "256")


def audit_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:8]


# ---- beyond loopback without a key: run-time updates are off ----------------------------------------------------


def test_open_host_without_key_refuses_updates_on_every_api(llama_dir, adapter_dirs, tmp_path):
    """Bound to 0.0.0.0 (so not loopback), reached through 127.0.0.1."""
    audit, rpc_addr = tmp_path / "audit.jsonl", f"ipc://{tmp_path}/rpc.sock"
    with ServerProcess("--model-path", str(llama_dir), "--host", "0.0.0.0", *LORA, "--lora-paths",
                       f"a4={adapter_dirs['a4']}", "--rpc-addr", rpc_addr, "--audit-log", str(audit)) as server, \
            RpcClient(rpc_addr, timeout_s=60) as client:
        log = server.log()
        assert "run-time adapter updates: off" in log and "--allow-unauthenticated-lora-updates" in log
        load, unload = {"lora_name": "x", "lora_path": str(adapter_dirs["a8"])}, {"lora_name": "a4"}
        for path, body in (("/load_lora_adapter", load), ("/v1/load_lora_adapter", load),
                           ("/unload_lora_adapter", unload), ("/v1/unload_lora_adapter", unload)):
            resp = server.post(path, body)
            assert resp.status_code == 403 and "updates_disabled" in resp.text, (path, resp.text)
        with pytest.raises(RpcCallError, match="updates_disabled"):
            client.load_lora_adapter("x", str(adapter_dirs["a8"]))
        with pytest.raises(RpcCallError, match="updates_disabled"):
            client.unload_lora_adapter("a4")
        # the start-up adapter serves as before
        out = server.post("/generate", {"text": "Once upon", "lora_path": "a4", "sampling_params": GREEDY})
        assert out.status_code == 200, out.text
        assert [a["lora_name"] for a in server.get("/lora_adapters").json()["adapters"]] == ["a4"]
        lines = audit_lines(audit)
        assert [(e["op"], e["outcome"], e["client"]) for e in lines[:1]] == [("load", "ok", None)]  # start-up
        refusals = lines[1:]
        assert [(e["op"], e["names"], e["outcome"]) for e in refusals] == [
            ("load", ["x"], "updates_disabled"), ("load", ["x"], "updates_disabled"),
            ("unload", ["a4"], "updates_disabled"), ("unload", ["a4"], "updates_disabled"),
            ("load", ["x"], "updates_disabled"), ("unload", ["a4"], "updates_disabled")]
        assert all(e["client"].startswith("127.0.0.1:") for e in refusals[:4])  # HTTP: the client's address
        assert all(e["client"].startswith("rpc:") for e in refusals[4:]) and refusals[0]["paths"] == [load["lora_path"]]
        assert server.get("/audit_log").json()["entries"] == lines  # what the console shows


def test_open_host_with_the_opt_out_takes_updates_and_warns(llama_dir, adapter_dirs):
    with ServerProcess("--model-path", str(llama_dir), "--host", "0.0.0.0", *LORA,
                       "--allow-unauthenticated-lora-updates") as server:
        assert "run-time adapter updates: on" in server.log()
        assert "without --lora-path-root: any directory" in server.log()
        resp = server.post("/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapter_dirs["a8"])})
        assert resp.status_code == 200, resp.text


# ---- a keyed loopback server: integrity refusals, the audit trail, CURVE on the RPC ------------------------------


@pytest.fixture(scope="module")
def keyed_server(llama_dir, adapter_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("security")
    cluster_key = root / "cluster.key"
    write_key_file(str(cluster_key))
    adapters = {}
    for name, base in (("good", str(llama_dir)), ("other_base", "meta-llama/Llama-3.1-8B"), ("unlisted", None),
                       ("tampered", str(llama_dir)), ("local_base", "/home/me/ckpt/base")):
        adapters[name] = root / name
        shutil.copytree(adapter_dirs["a8"], adapters[name])
        config = json.loads((adapters[name] / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = base or str(llama_dir)
        (adapters[name] / "adapter_config.json").write_text(json.dumps(config))
        if name != "unlisted":
            write_manifest(adapters[name])
    weights = adapters["tampered"] / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")  # one byte changed after the manifest was written
    rpc_port = free_port()
    audit = root / "audit.jsonl"
    # served under a Hub model's name, so an adapter for another Hub model is refused (a local name alone never is)
    with ServerProcess("--model-path", str(llama_dir), "--served-model-name", "meta-llama/Llama-3.2-1B", *LORA,
                       "--api-key", KEY, "--lora-require-manifest",
                       "--audit-log", str(audit), "--rpc-addr", f"tcp://127.0.0.1:{rpc_port}",
                       "--cluster-key-file", str(cluster_key)) as server:
        yield server, adapters, audit, rpc_port, str(cluster_key), root


def test_integrity_refusals_on_both_apis_and_the_rpc(keyed_server):
    server, adapters, audit, rpc_port, cluster_key, _ = keyed_server
    auth = {"Authorization": f"Bearer {KEY}"}
    expected = {"other_base": "base_model_mismatch", "unlisted": "manifest_missing", "tampered": "manifest_mismatch"}
    with RpcClient(f"tcp://127.0.0.1:{rpc_port}", api_key=KEY, timeout_s=60, cluster_key_file=cluster_key) as client:
        for name, kind in expected.items():
            body = {"lora_name": name, "lora_path": str(adapters[name])}
            for path in ("/load_lora_adapter", "/v1/load_lora_adapter"):
                resp = server.post(path, body, headers=auth)
                assert resp.status_code == 400 and kind in resp.text, (path, resp.text)
            out = client.load_lora_adapter(name, str(adapters[name]))
            assert not out.success and out.results[0].error_kind == kind
        mismatch = server.post("/load_lora_adapter", {"lora_name": "b", "lora_path": str(adapters["other_base"])},
                               headers=auth).json()["error_message"]
        assert "meta-llama/Llama-3.1-8B" in mismatch and server.get("/v1/models", headers=auth).json()["data"][0][
            "id"] in mismatch  # names both models
        assert client.load_lora_adapter("good", str(adapters["good"])).success
        assert client.unload_lora_adapter("good").success
        assert client.load_lora_adapter("local_base", str(adapters["local_base"])).success  # cannot tell: a warning
        assert client.unload_lora_adapter("local_base").success
    warned = [line for line in server.log().splitlines() if "'/home/me/ckpt/base'" in line]
    assert len(warned) == 1 and "meta-llama/Llama-3.2-1B" in warned[0], warned
    lines = audit_lines(audit)
    outcomes = [(e["op"], e["names"], e["outcome"]) for e in lines]
    for name, kind in expected.items():
        assert outcomes.count(("load", [name], kind)) == 3  # native, /v1, RPC
    assert ("load", ["good"], "ok") in outcomes and ("unload", ["good"], "ok") in outcomes
    assert all(e["key_id"] == key_id(KEY) for e in lines) and KEY not in audit.read_text()


def test_wrong_api_key_is_refused_and_audited(keyed_server):
    server, adapters, audit, rpc_port, cluster_key, _ = keyed_server
    body = {"lora_name": "good", "lora_path": str(adapters["good"])}
    before = len(audit_lines(audit))
    assert server.post("/load_lora_adapter", body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "good"}).status_code == 401
    with RpcClient(f"tcp://127.0.0.1:{rpc_port}", api_key="wrong", timeout_s=60,
                   cluster_key_file=cluster_key) as client:
        with pytest.raises(RpcCallError, match="API key"):
            client.load_lora_adapter("good", str(adapters["good"]))
    new = audit_lines(audit)[before:]
    assert [(e["op"], e["outcome"], e["key_id"]) for e in new] == [
        ("load", "unauthorized", key_id("wrong")), ("unload", "unauthorized", None),
        ("load", "unauthorized", key_id("wrong"))]
    assert new[2]["names"] == ["good"] and new[2]["client"].startswith("rpc:127.0.0.1")
    assert server.get("/audit_log").status_code == 401  # the console's route takes the key
    assert server.get("/audit_log", headers={"Authorization": f"Bearer {KEY}"}).json()["entries"][-1] == new[-1]


def test_rpc_over_tcp_is_encrypted_and_refuses_a_wrong_cluster_key(keyed_server):
    server, _, _, rpc_port, cluster_key, root = keyed_server
    prompt = "Secret plans for the harbour"
    relay = Relay(rpc_port)
    try:
        with RpcClient(f"tcp://127.0.0.1:{relay.port}", api_key=KEY, timeout_s=60,
                       cluster_key_file=cluster_key) as client:
            out = client.generate(prompt, GREEDY)[0]
        with relay.lock:
            seen = bytes(relay.seen)
        assert out["text"] and len(seen) > 100  # the reply came back through the relay
        assert prompt.encode() not in seen and out["text"].encode() not in seen and KEY.encode() not in seen
    finally:
        relay.close()
    wrong = root / "wrong.key"
    write_key_file(str(wrong))
    with RpcClient(f"tcp://127.0.0.1:{rpc_port}", api_key=KEY, timeout_s=3, cluster_key_file=str(wrong)) as client:
        with pytest.raises(TimeoutError):
            client.generate(prompt, GREEDY)
    with RpcClient(f"tcp://127.0.0.1:{rpc_port}", api_key=KEY, timeout_s=3) as client:  # no key at all
        with pytest.raises(TimeoutError):
            client.generate(prompt, GREEDY)
    assert server.wait_log("refused", 10) and "CURVE handshake failed" in server.log()
