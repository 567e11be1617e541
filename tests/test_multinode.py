"""Multi-node tensor parallelism on one machine: two "nodes" over loopback (`--tp 2 --nnodes 2`, one rank each).

Node 1 runs with a fault hook that fails any adapter sent to it as a path, so an adapter that loads there came as
tensor frames from node 0: node 1 never reads the path."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests
from transformers import AutoTokenizer

from frontend.adapter_tensors import read_adapter_dir
from protocol.config import ConfigError, ServerConfig
from protocol.structs import TENSOR_DTYPES
from tests.reference import assert_greedy_match, hf_greedy
from tests.server_utils import REPO_ROOT, ServerProcess, free_port
from tests.test_server_lifecycle import alive, wait_until

GREEDY = {"max_new_tokens": 10, "temperature": 0}
PROMPTS = ["Once upon a time", "The quick brown fox"]


class HeadlessNode:
    """Node 1 of two: started before node 0 (it waits for node 0's store), stopped with its whole session."""

    def __init__(self, flags: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        hooks = json.dumps({"refuse_path_loads": "1"})
        env = dict(os.environ, HF_HUB_OFFLINE="1", LORAPLEX_TEST_FAULT_HOOKS=hooks)
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"loraplex-node1-{self.port}.log")
        self._log = open(self.log_path, "w")
        cmd = [
            sys.executable,
            os.path.join(REPO_ROOT, "scripts", "launch_server.py"),
            *flags,
            "--node-rank",
            "1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
        ]
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def health(self) -> int:
        try:
            return requests.get(self.url + "/health", timeout=2).status_code
        except requests.RequestException:
            return -1

    def pids(self) -> list[int]:
        try:
            return [self.proc.pid] + [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


@pytest.fixture
def two_nodes(llama_dir):
    flags = [
        "--model-path",
        str(llama_dir),
        "--tp",
        "2",
        "--nnodes",
        "2",
        "--dist-init-addr",
        f"127.0.0.1:{free_port()}",
        "--enable-lora",
        "--max-lora-rank",
        "16",
        "--lora-target-modules",
        "all",
        "--max-total-tokens",
        "2048",
        "--context-length",
        "512",
    ]
    node1 = HeadlessNode(flags)
    try:
        with ServerProcess(*flags, "--node-rank", "0") as node0:
            yield node0, node1
    finally:
        node1.stop()


def test_two_nodes_equal_hf_and_peft_and_node1_reads_no_path(two_nodes, llama_dir, adapter_dirs):
    node0, node1 = two_nodes
    assert wait_until(lambda: node1.health() == 200, 10)
    assert requests.get(node1.url + "/generate", timeout=5).status_code == 404  # headless: /health only
    assert len(node0.get("/server_info").json()["process_ids"]) == 2  # node 0: its scheduler and rank 0
    resp = node0.post("/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapter_dirs["a16"])})
    assert resp.status_code == 200, resp.text  # node 1 refuses any path: it got the adapter as tensors
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    for prompt in PROMPTS:
        for name, adapter_dir in ((None, None), ("x", adapter_dirs["a16"])):
            out = node0.post("/generate", {"text": prompt, "lora_path": name, "sampling_params": GREEDY})
            assert out.status_code == 200, out.text
            ref, margins = hf_greedy(
                llama_dir, tokenizer(prompt)["input_ids"], GREEDY["max_new_tokens"], adapter_dir, eos_token_ids=(2, 4)
            )
            assert_greedy_match(out.json()["output_ids"], ref, margins, f"{name} / {prompt}")
    assert node0.post("/unload_lora_adapter", {"lora_name": "x"}).status_code == 200


def test_killing_node1_makes_node0_unhealthy_and_leaves_no_process(two_nodes):
    node0, node1 = two_nodes
    assert wait_until(lambda: node1.health() == 200, 10)
    pids = list(node0.get("/server_info").json()["process_ids"].values()) + node1.pids()
    long = {"max_new_tokens": 400, "ignore_eos": True}
    with requests.post(
        node0.url + "/generate", json={"text": "Hi", "stream": True, "sampling_params": long}, stream=True, timeout=30
    ) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))
        os.killpg(node1.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        rest = [line for line in lines if line.startswith(b"data: ")]
    assert rest[-1] == b"data: [DONE]" and b"error" in rest[-2]  # the pending request failed, no hang
    assert wait_until(lambda: node0.get("/health").status_code == 503, 10 - (time.monotonic() - t0))
    assert time.monotonic() - t0 < 10
    node0.proc.send_signal(signal.SIGTERM)
    assert node0.proc.wait(timeout=30) == 0
    assert wait_until(lambda: not any(alive(pid) for pid in pids), 10), "orphan processes"


def test_losing_node0_stops_node1_with_nonzero_exit(two_nodes):
    node0, node1 = two_nodes
    assert wait_until(lambda: node1.health() == 200, 10)
    pids = node1.pids()
    assert len(pids) == 2  # node 1's launcher and its rank
    os.killpg(node0.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    assert node1.proc.wait(timeout=30) != 0
    assert time.monotonic() - t0 < 30
    assert wait_until(lambda: not any(alive(pid) for pid in pids), 5), "node 1 left processes"


def test_multinode_flags():
    with pytest.raises(ConfigError, match="--dist-init-addr"):
        ServerConfig(nnodes=2, tp=2)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        ServerConfig(nnodes=2, tp=2, dist_init_addr="node0")
    assert ServerConfig(nnodes=2, tp=2, node_rank=1, dist_init_addr="10.0.0.1:29500").node_rank == 1


def test_node0_reads_an_adapter_as_tensors_inside_the_root_only(adapter_dirs, tmp_path):
    config, specs, buffers = read_adapter_dir(str(adapter_dirs["a4"]), root=None)
    assert config["r"] == 4 and len(specs) == len(buffers) > 0
    assert all(
        len(buf) == math.prod(spec.shape) * TENSOR_DTYPES[spec.dtype] for spec, buf in zip(specs, buffers, strict=True)
    )
    (tmp_path / "root").mkdir()
    escaped = tmp_path / "root" / "escaped"
    escaped.mkdir()
    (escaped / "adapter_config.json").symlink_to(adapter_dirs["a4"] / "adapter_config.json")
    with pytest.raises(ValueError, match="outside the allowed root"):
        read_adapter_dir(str(escaped), root=str(tmp_path / "root"))
