"""Multi-node tensor parallelism between two hosts on a real network: three network namespaces on one bridge
(10.77.0.1-3, no loopback between them). Host A runs node 0, host B node 1 (`--tp 2 --nnodes 2`, one rank each,
`--cluster-key-file`, the collectives bound to eth0 by `--dist-interface`). Host C has the address space but not the
key: it cannot write the rendezvous store, join as a node or load an adapter, and each refusal is logged. A capture on
the bridge shows neither the prompts nor the adapter's bytes; killing host B's processes makes node 0 answer 503
within 10 s, as on loopback (tests/server/test_multinode.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import requests
from loraplex.protocol.curve import write_key_file
from safetensors.numpy import load_file
from transformers import AutoTokenizer

from tests.netns import bridged_hosts
from tests.reference import assert_greedy_match, hf_greedy
from tests.server_utils import LAUNCH

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
STORE_PORT, HTTP_PORT = 29555, 8000
ADMIN = "admin-key"
GREEDY = {"max_new_tokens": 8, "temperature": 0}
PROMPT = "Once upon a time"
START_TIMEOUT_S = 300.0
STRANGER_WRITES = """
import sys
from datetime import timedelta
from loraplex.protocol.curve import ClusterKey
from loraplex.protocol.curve_store import CurveStoreClient, StoreError
key_file, host, port = sys.argv[1:]
store = CurveStoreClient(host, int(port), ClusterKey.load(key_file), timeout=timedelta(seconds=5))
try:
    store.set("loraplex/failed", b"stop the cluster")
except StoreError as e:
    print(e)
"""


class Node:
    """A server process inside a host's namespace, in a session of its own (killed as a whole), logging to a file."""

    def __init__(self, host, args: list[str], log_path):
        self.host, self.log_path = host, log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([*host.prefix(), *LAUNCH, *args], stdout=log, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, HF_HUB_OFFLINE="1"), start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_log(self, text: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                return text in self.log()
            time.sleep(0.25)
        return True

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def http(host, method: str, url: str, **kwargs) -> requests.Response:
    return host.call(requests.request, method, url, timeout=kwargs.pop("timeout", 60), **kwargs)


def status(host, url: str) -> int:
    try:
        return http(host, "GET", url, timeout=2).status_code
    except requests.RequestException:
        return -1


@pytest.fixture(scope="module")
def cluster(llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two_hosts")
    write_key_file(str(tmp / "cluster.key"))
    write_key_file(str(tmp / "stranger.key"))
    switch, hosts = bridged_hosts(f"lpx{os.getpid() % 100000}", 3)
    (a, addr_a), (b, addr_b), (c, _) = hosts
    capture = tmp / "bridge.pcap"
    dump = subprocess.Popen([*switch.prefix(), "tcpdump", "-i", "br0", "-U", "-s", "0", "-w", str(capture)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    flags = ["--cluster-key-file", str(tmp / "cluster.key"), "--model-path", str(llama_dir), "--device", "cpu",
             "--tp", "2", "--nnodes", "2", "--dist-init-addr", f"{addr_a}:{STORE_PORT}", "--dist-interface", "eth0",
             "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all", "--max-total-tokens", "2048",
             "--context-length", "512", "--admin-api-key", ADMIN]
    nodes = []
    try:
        nodes.append(Node(b, [*flags, "--node-rank", "1", "--host", addr_b, "--port", str(HTTP_PORT)], tmp / "b.log"))
        nodes.append(Node(a, [*flags, "--node-rank", "0", "--host", addr_a, "--port", str(HTTP_PORT)], tmp / "a.log"))
        url = f"http://{addr_a}:{HTTP_PORT}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while status(a, url + "/health") != 200:
            assert all(n.proc.poll() is None for n in nodes), nodes[1].log()[-3000:] + nodes[0].log()[-3000:]
            assert time.monotonic() < deadline, nodes[1].log()[-3000:]
            time.sleep(1)
        yield {"a": a, "b": b, "c": c, "url": url, "nodes": nodes, "tmp": tmp, "flags": flags,
               "capture": capture, "dump": dump, "addr_b": addr_b}
    finally:
        for node in nodes:
            node.kill()
        if dump.poll() is None:
            dump.send_signal(signal.SIGINT)
            dump.wait(timeout=10)
        for ns in [switch, *(h for h, _ in hosts)]:
            ns.delete()


def test_tp_across_two_hosts_equals_hf(cluster, llama_dir, adapter_dirs):
    a, url = cluster["a"], cluster["url"]
    admin = {"Authorization": f"Bearer {ADMIN}"}
    loaded = http(a, "POST", url + "/load_lora_adapter", headers=admin,
                  json={"lora_name": "x", "lora_path": str(adapter_dirs["a16"])})
    assert loaded.status_code == 200, loaded.text
    ids = AutoTokenizer.from_pretrained(llama_dir)(PROMPT)["input_ids"]
    for name, adapter_dir in ((None, None), ("x", adapter_dirs["a16"])):
        out = http(a, "POST", url + "/generate", json={"text": PROMPT, "lora_path": name, "sampling_params": GREEDY})
        assert out.status_code == 200, out.text
        ref, margins = hf_greedy(llama_dir, ids, GREEDY["max_new_tokens"], adapter_dir, eos_token_ids=(2, 4))
        assert_greedy_match(out.json()["output_ids"], ref, margins, f"{name}")
    assert "rank 1 of 2, gloo" in cluster["nodes"][0].log()  # host B's rank joined the group over the bridge


def test_a_third_host_without_the_key_gets_nothing(cluster):
    c, url, node0 = cluster["c"], cluster["url"], cluster["nodes"][1]
    addr_a = url.split("//")[1].split(":")[0]
    # the rendezvous store: no write, no read (5 s: long enough for its refused handshake on a busy machine). A process
    # of its own in host C: zmq connects from its context's I/O thread, which lives in the namespace it started in
    stranger = subprocess.run([*c.prefix(), sys.executable, "-c", STRANGER_WRITES, str(cluster["tmp"] / "stranger.key"),
                               addr_a, str(STORE_PORT)], capture_output=True, text=True, timeout=60)
    assert stranger.returncode == 0 and "did not answer" in stranger.stdout, stranger.stdout + stranger.stderr
    assert node0.wait_log("CURVE handshake failed", 30), node0.log()[-3000:]
    # an adapter load without the admin key
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = http(c, "POST", url + "/load_lora_adapter", headers=headers,
                       json={"lora_name": "evil", "lora_path": "/tmp"})
        assert refused.status_code == 401, refused.text
    # joining as node 1 with another key: the store refuses it, both sides log it, the cluster keeps serving
    flags = list(cluster["flags"])
    flags[flags.index("--cluster-key-file") + 1] = str(cluster["tmp"] / "stranger.key")
    intruder = Node(c, [*flags, "--node-rank", "1", "--host", "10.77.0.3", "--port", str(HTTP_PORT)],
                    cluster["tmp"] / "c.log")
    try:
        assert intruder.wait_log("CURVE handshake failed", 120), intruder.log()[-3000:]
    finally:
        intruder.kill()
    assert status(cluster["a"], url + "/health") == 200
    assert "stop the cluster" not in node0.log()


def test_the_wire_between_hosts_carries_no_prompt_or_adapter_bytes(cluster, adapter_dirs):
    dump = cluster["dump"]
    time.sleep(1)  # -U writes each packet at once; a moment for the last ones
    dump.send_signal(signal.SIGINT)
    dump.wait(timeout=10)
    wire = cluster["capture"].read_bytes()
    assert len(wire) > 100_000  # the capture saw the two hosts' traffic (the model's collectives, the batches)
    assert PROMPT.encode() not in wire
    tensors = load_file(str(adapter_dirs["a16"] / "adapter_model.safetensors"))
    for name, array in list(tensors.items())[:8]:  # 32-byte runs of each tensor, as fp32 on the wire
        raw = array.astype("float32").tobytes()
        for start in range(0, min(len(raw) - 32, 4096), 512):
            assert raw[start : start + 32] not in wire, name


def test_killing_host_b_makes_node0_unhealthy_within_10_s(cluster):
    a, url = cluster["a"], cluster["url"]
    cluster["nodes"][0].kill()  # host B's node, its ranks with it
    t0 = time.monotonic()
    while status(a, url + "/health") != 503:
        assert time.monotonic() - t0 < 10, "node 0 still healthy 10 s after host B died"
        time.sleep(0.2)
