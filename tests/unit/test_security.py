"""Operators' controls without a server: safe defaults, the cluster key's file and its CURVE sockets (refused peers,
no plaintext on the wire), the audit log's lines and rotation, the adapter integrity checks."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time

import pytest
import zmq
from loraplex.frontend.adapters.audit import AuditLog, Caller, key_id
from loraplex.frontend.adapters.integrity import MANIFEST_FILE, AdapterIntegrity
from loraplex.frontend.adapters.manager import update_policy
from loraplex.frontend.entrypoints.cli import config_from_args
from loraplex.frontend.entrypoints.launch import main as launch_main
from loraplex.protocol.adapters.adapter_config import AdapterLoadError
from loraplex.protocol.config import ConfigError, ServerConfig, is_loopback_host
from loraplex.protocol.curve import ClusterKey, ClusterKeyError, write_key_file
from loraplex.protocol.sockets import PULL, PUSH, TypedSocket
from loraplex.protocol.structs import AbortReq

from tests.manifests import write_manifest
from tests.relay import Relay

# ---- safe defaults ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.5", "localhost", "::1"])
def test_loopback_keeps_updates_open(host):
    assert is_loopback_host(host)
    assert not ServerConfig(host=host).lora_updates_need_key
    assert update_policy(ServerConfig(host=host)) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "example.com"])
def test_non_loopback_without_key_closes_updates(host, caplog):
    assert not is_loopback_host(host)
    with caplog.at_level(logging.INFO, logger="loraplex.adapters"):
        refusal = update_policy(ServerConfig(host=host))
    assert refusal is not None and refusal[1] == "updates_disabled" and "updates_disabled" in refusal[0]
    assert "--allow-unauthenticated-lora-updates" in caplog.text  # the log says how to turn them on
    for opened in ({"api_key": "k"}, {"admin_api_key": "k"}, {"allow_unauthenticated_lora_updates": True}):
        assert not ServerConfig(host=host, **opened).lora_updates_need_key
        assert update_policy(ServerConfig(host=host, **opened)) is None


def test_open_updates_beyond_loopback_without_path_root_warn(caplog):
    with caplog.at_level(logging.INFO, logger="loraplex.adapters"):
        update_policy(ServerConfig(host="0.0.0.0", api_key="k"))
    assert any(r.levelno == logging.WARNING and "--lora-path-root" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="loraplex.adapters"):
        update_policy(ServerConfig(host="0.0.0.0", api_key="k", lora_path_root="/srv/adapters"))
        update_policy(ServerConfig())  # loopback: today's defaults, no warning
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ---- the cluster key ------------------------------------------------------------------------------------------


def test_cluster_key_required_beyond_one_host():
    with pytest.raises(ConfigError, match="--cluster-key-file"):
        config_from_args(["--nnodes", "2", "--tp", "2", "--dist-init-addr", "127.0.0.1:29500"])
    with pytest.raises(ConfigError, match="--cluster-key-file"):
        config_from_args(["--rpc-addr", "tcp://0.0.0.0:5555", "--api-key", "k"])
    assert config_from_args(["--rpc-addr", "tcp://127.0.0.1:5555"]).cluster_key_file is None  # loopback: as today


def test_dist_interface_names_one_of_the_hosts_interfaces():
    assert config_from_args(["--dist-interface", "lo"]).dist_interface == "lo"
    with pytest.raises(ConfigError, match="--dist-interface nosuch0: no such network interface here .*lo"):
        config_from_args(["--dist-interface", "nosuch0"])


def test_dist_interface_binds_the_collectives(monkeypatch):
    """The rank exports the interface to both backends before it makes its group (tp=1 makes none)."""
    from loraplex.worker.dist import init_distributed

    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "unset-after")  # the test's end restores the variables as they were
    made = []
    monkeypatch.setattr("torch.distributed.init_process_group", lambda **kw: made.append(dict(os.environ)))
    import torch

    init_distributed(config_from_args(["--tp", "2", "--dist-interface", "lo"]), "127.0.0.1:1", 0, torch.device("cpu"))
    assert made[0]["GLOO_SOCKET_IFNAME"] == made[0]["NCCL_SOCKET_IFNAME"] == "lo"


def test_keygen_writes_an_owner_only_key_and_never_overwrites(tmp_path, capsys):
    path = str(tmp_path / "cluster.key")
    launch_main(["keygen", path])
    assert os.stat(path).st_mode & 0o777 == 0o600
    key = ClusterKey.load(path)
    assert len(key.public) == len(key.secret) == 40 and key.public != key.secret
    with pytest.raises(SystemExit) as info:
        launch_main(["keygen", path])
    assert info.value.code == 1 and "never overwritten" in capsys.readouterr().err
    assert ClusterKey.load(path).secret == key.secret


def test_a_key_file_open_to_others_or_missing_stops_the_start(tmp_path, capsys):
    path = str(tmp_path / "cluster.key")
    write_key_file(path)
    os.chmod(path, 0o644)
    with pytest.raises(ClusterKeyError, match="chmod 600"):
        ClusterKey.load(path)
    with pytest.raises(SystemExit) as info:
        launch_main(["--cluster-key-file", path])
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(lines) == 1 and "readable by others" in lines[0]
    with pytest.raises(ClusterKeyError, match="No such file"):
        ClusterKey.load(str(tmp_path / "absent.key"))


@pytest.fixture
def two_keys(tmp_path):
    paths = [str(tmp_path / "a.key"), str(tmp_path / "b.key")]
    for path in paths:
        write_key_file(path)
    return [ClusterKey.load(p) for p in paths]


def test_curve_socket_admits_only_the_cluster_key_and_logs_refusals(two_keys, caplog):
    right, wrong = two_keys
    server = TypedSocket(PULL, "tcp://127.0.0.1:0", bind=True, recv_type=AbortReq, key=right)
    addr = server.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    impostor_public, impostor_secret = zmq.curve_keypair()  # knows the server's public key, not its secret
    try:
        with caplog.at_level(logging.WARNING, logger="loraplex.curve"):
            for key in (wrong, None):
                client = TypedSocket(PUSH, addr, bind=False, key=key)
                client.send(AbortReq(rid="refused"))
                assert server.recv(timeout_ms=1500) is None
                client.close()
            impostor = zmq.Context.instance().socket(zmq.PUSH)
            impostor.linger = 0
            impostor.curve_serverkey, impostor.curve_publickey = right.public, impostor_public
            impostor.curve_secretkey = impostor_secret
            impostor.connect(addr)
            impostor.send(b"x")
            assert server.recv(timeout_ms=1500) is None
            impostor.close()
        refusal = f"refused 1 peer connection(s) on {addr}"
        deadline = time.monotonic() + 10  # logged by the socket's monitor, which may trail on a loaded machine
        while refusal not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refusal in caplog.text
        client = TypedSocket(PUSH, addr, bind=False, key=right)
        client.send(AbortReq(rid="admitted"))
        assert server.recv(timeout_ms=5000) == AbortReq(rid="admitted")
        client.close()
    finally:
        server.close()


@pytest.mark.parametrize("secured", [False, True])
def test_curve_traffic_on_the_wire_is_not_plaintext(two_keys, secured):
    secret_text = "the prompt nobody on the wire may read"
    key = two_keys[0] if secured else None
    server = TypedSocket(PULL, "tcp://127.0.0.1:0", bind=True, recv_type=AbortReq, key=key)
    port = int(server.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
    relay = Relay(port)
    client = TypedSocket(PUSH, f"tcp://127.0.0.1:{relay.port}", bind=False, key=key)
    try:
        client.send(AbortReq(rid=secret_text))
        assert server.recv(timeout_ms=5000) == AbortReq(rid=secret_text)  # it went through the relay
        with relay.lock:
            seen = bytes(relay.seen)
        # plain ZeroMQ shows the text (the relay sees what a sniffer would); CURVE does not
        assert (secret_text.encode() in seen) is not secured
    finally:
        client.close()
        server.close()
        relay.close()


# ---- the audit log ---------------------------------------------------------------------------------------------


def test_audit_lines_have_exactly_the_fields_and_never_the_key(tmp_path):
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path))
    caller = Caller.presenting("10.0.0.7:5123", "sk-secret")
    with audit.operation("load", ["a"], ["/adapters/a"], caller):
        pass
    with pytest.raises(AdapterLoadError), audit.operation("unload", ["b"], [None], caller):
        raise AdapterLoadError("x", "busy")  # not a ServerError: counted as internal
    audit.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [set(line) for line in lines] == [{"time", "op", "op_id", "names", "paths", "key_id", "client", "outcome",
                                              "duration_ms"}] * 2
    first, second = lines
    assert (first["op"], first["names"], first["paths"], first["outcome"]) == ("load", ["a"], ["/adapters/a"], "ok")
    assert first["key_id"] == hashlib.sha256(b"sk-secret").hexdigest()[:8] == key_id("sk-secret")
    assert first["client"] == "10.0.0.7:5123" and first["op_id"] != second["op_id"]
    assert (second["op"], second["outcome"]) == ("unload", "internal")
    assert "sk-secret" not in path.read_text()
    assert [e.op for e in audit.recent] == ["load", "unload"]


def test_audit_log_rotates(tmp_path, monkeypatch):
    monkeypatch.setattr("loraplex.frontend.adapters.audit.ROTATE_BYTES", 2000)
    path = tmp_path / "audit.jsonl"
    audit = AuditLog(str(path))
    for i in range(40):
        audit.record("evict", [f"adapter{i}"], [None], Caller(), "ok")
    audit.close()
    assert os.path.getsize(path) <= 2000 and (tmp_path / "audit.jsonl.1").exists()
    rotated = (tmp_path / "audit.jsonl.1").read_text() + path.read_text()
    assert json.loads(rotated.splitlines()[-1])["names"] == ["adapter39"]


# ---- adapter integrity -----------------------------------------------------------------------------------------


@pytest.fixture
def adapter_copy(adapter_dirs, tmp_path):
    path = tmp_path / "adapter"
    shutil.copytree(adapter_dirs["a4"], path)
    return path


def set_base(path, base: str) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = base
    (path / "adapter_config.json").write_text(json.dumps(config))


def test_base_model_compared_by_last_component_and_served_name(adapter_copy, llama_dir, caplog):
    integrity = AdapterIntegrity(ServerConfig(model_path=str(llama_dir), served_model_name="tiny-chat"))
    with caplog.at_level(logging.WARNING, logger="loraplex.adapters"):
        for base in (str(llama_dir), f"/elsewhere/{llama_dir.name.upper()}", f"org/{llama_dir.name}", "tiny-chat",
                     "TINY-chat"):
            set_base(adapter_copy, base)
            integrity.check_dir("x", str(adapter_copy), None)
        assert not caplog.records  # the served model's names: no warning
        set_base(adapter_copy, "meta-llama/Llama-3.1-8B")  # a local checkpoint cannot be told apart: one warning
        integrity.check_dir("x", str(adapter_copy), None)
    assert len(caplog.records) == 1 and "meta-llama/Llama-3.1-8B" in caplog.text and "'tiny-chat'" in caplog.text
    strict = AdapterIntegrity(ServerConfig(model_path=str(llama_dir), served_model_name="tiny-chat",
                                           lora_strict_base_match=True))
    with pytest.raises(AdapterLoadError) as info:
        strict.check_dir("x", str(adapter_copy), None)
    assert info.value.kind == "base_model_mismatch"
    assert "meta-llama/Llama-3.1-8B" in str(info.value) and "'tiny-chat'" in str(info.value)  # names both
    with pytest.raises(AdapterLoadError, match="base_model_mismatch"):  # inline adapters are checked too
        strict.check_config("x", {"base_model_name_or_path": "other"})
    strict.check_config("x", {"base_model_name_or_path": None})  # names none: nothing to compare


def test_a_quantized_name_matches_its_base_both_ways(adapter_copy, tmp_path, caplog):
    """A QLoRA adapter names the quantized checkpoint, a full-precision one the base: either loads on the other, as
    the quantized checkpoint's name only adds its method's words (AWQ-INT4, FP8, quantized.w4a16, bnb-4bit)."""
    with caplog.at_level(logging.WARNING, logger="loraplex.adapters"):
        for served, trained_for in (("Meta-Llama-3.1-8B-Instruct-AWQ-INT4", "meta-llama/Meta-Llama-3.1-8B-Instruct"),
                                    ("Meta-Llama-3.1-8B-Instruct-quantized.w4a16",
                                     "meta-llama/Meta-Llama-3.1-8B-Instruct"),
                                    ("Qwen3-8B-FP8", "Qwen/Qwen3-8B"),
                                    ("Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4"),
                                    ("llama-3-8b", "unsloth/llama-3-8b-bnb-4bit")):
            integrity = AdapterIntegrity(ServerConfig(model_path=str(tmp_path / served), lora_strict_base_match=True))
            set_base(adapter_copy, trained_for)
            integrity.check_dir("x", str(adapter_copy), None)
    assert not caplog.records  # the same model by name: no warning, even under --lora-strict-base-match
    integrity = AdapterIntegrity(ServerConfig(model_path="RedHatAI/Qwen3-8B-FP8"))  # a Hub id: names its model
    for other in ("Qwen/Qwen3-4B", "Qwen/Qwen3-4B-FP8"):  # another model stays refused
        set_base(adapter_copy, other)
        with pytest.raises(AdapterLoadError, match="base_model_mismatch"):
            integrity.check_dir("x", str(adapter_copy), None)
    strict = AdapterIntegrity(ServerConfig(model_path=str(tmp_path / "Qwen3-8B-FP8"), lora_strict_base_match=True))
    for other in ("Qwen/Qwen3-4B", "FP8", "Qwen/Qwen3-8B-Base"):  # not its name: refused when strict
        set_base(adapter_copy, other)
        with pytest.raises(AdapterLoadError, match="base_model_mismatch"):
            strict.check_dir("x", str(adapter_copy), None)


def test_base_mismatch_allowed_with_a_warning(adapter_copy, llama_dir, caplog):
    set_base(adapter_copy, "meta-llama/Llama-3.1-8B")
    integrity = AdapterIntegrity(ServerConfig(model_path=str(llama_dir), lora_allow_base_mismatch=True))
    with caplog.at_level(logging.WARNING, logger="loraplex.adapters"):
        integrity.check_dir("x", str(adapter_copy), None)
    assert "--lora-allow-base-mismatch" in caplog.text


def test_manifest_required_complete_and_matching(adapter_copy, llama_dir):
    integrity = AdapterIntegrity(ServerConfig(model_path=str(llama_dir), lora_require_manifest=True))
    with pytest.raises(AdapterLoadError) as info:
        integrity.check_dir("x", str(adapter_copy), None)
    assert info.value.kind == "manifest_missing"
    write_manifest(adapter_copy)
    integrity.check_dir("x", str(adapter_copy), str(adapter_copy.parent))  # inside a root too
    AdapterIntegrity(ServerConfig(model_path=str(llama_dir))).check_dir("x", str(adapter_copy), None)
    weights = adapter_copy / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    with pytest.raises(AdapterLoadError) as info:
        integrity.check_dir("x", str(adapter_copy), None)
    assert info.value.kind == "manifest_mismatch" and "adapter_model.safetensors" in str(info.value)
    manifest = json.loads((adapter_copy / MANIFEST_FILE).read_text())
    del manifest["files"]["adapter_model.safetensors"]
    (adapter_copy / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(AdapterLoadError) as info:  # a file that would be read but is not listed
        integrity.check_dir("x", str(adapter_copy), None)
    assert info.value.kind == "manifest_missing"
