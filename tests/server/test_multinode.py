"""Multi-node tensor parallelism on one machine: two "nodes" over loopback (`--tp 2 --nnodes 2`, one rank each).

Node 1 runs with an injected fault that fails any adapter sent to it as a path, so an adapter that loads there came as
tensor frames from node 0: node 1 never reads the path. Node 0 cuts every tensor per rank, so node 1 receives only its
part (its log says how many bytes came), and a rank fed its part keeps exactly what it keeps cutting the whole."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time

import psutil
import pytest
import requests
import torch
from loraplex.frontend.adapters.files import cut_per_rank, read_adapter_dir
from loraplex.protocol.adapters.lora_shards import cut_shape
from loraplex.protocol.adapters.lora_targets import TARGET_MODULES
from loraplex.protocol.config import ConfigError, ServerConfig
from loraplex.protocol.curve import write_key_file
from loraplex.protocol.structs import TENSOR_DTYPES, AdapterToLoad, LoadAdapters, TensorSpec, frames_of_rank
from loraplex.worker.lora.adapter import AdapterLoadError, PoolSpec, adapter_from_tensors, load_adapter
from loraplex.worker.model.config import ModelConfig
from transformers import AutoTokenizer

from tests.reference import assert_greedy_match, hf_greedy
from tests.server.test_server_lifecycle import alive, wait_until
from tests.server_utils import LAUNCH, ServerProcess, fault_env, free_port

GREEDY = {"max_new_tokens": 10, "temperature": 0}
PROMPTS = ["Once upon a time", "The quick brown fox"]


def rank_bytes(adapter_dir, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(bytes of `tp_rank`'s part of the adapter, bytes of the whole adapter), from the whole tensors' specs."""
    _, specs, _ = read_adapter_dir(str(adapter_dir), root=None)
    item = {spec.name: TENSOR_DTYPES[spec.dtype] for spec in specs}
    part = sum(math.prod(cut_shape(s.name, s.shape, tp_rank, tp_size)) * item[s.name] for s in specs)
    return part, sum(math.prod(s.shape) * item[s.name] for s in specs)


class HeadlessNode:
    """Node 1 of two: started before node 0 (it waits for node 0's store), stopped with its whole session."""

    def __init__(self, flags: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", **fault_env(refuse_path_loads=True))
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"loraplex-node1-{self.port}.log")
        self._log = open(self.log_path, "w")
        cmd = [
            *LAUNCH,
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

    def log(self) -> str:
        with open(self.log_path) as log:
            return log.read()

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
def two_nodes(llama_dir, tmp_path):
    write_key_file(str(tmp_path / "cluster.key"))  # CURVE between the nodes, as --nnodes > 1 requires
    flags = [
        "--cluster-key-file",
        str(tmp_path / "cluster.key"),
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
    with open(node1.log_path) as log:  # node 1's rank logs what came over the wire: rank 1's part, not the whole
        received = [int(n) for n in re.findall(r"tensor frames, (\d+) bytes, this rank's part", log.read())]
    part_bytes, whole_bytes = rank_bytes(adapter_dirs["a16"], 1, 2)
    assert received == [part_bytes] and part_bytes < whole_bytes
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


def test_node_with_a_wrong_cluster_key_is_refused_and_logged(llama_dir, tmp_path):
    """Node 1 holds another key: node 0's rendezvous store refuses its connection (and logs it), and node 1 refuses
    node 0's store in turn (and logs it), so the server never starts serving; nothing crosses between them."""
    keys = [str(tmp_path / "node0.key"), str(tmp_path / "node1.key")]
    for key in keys:
        write_key_file(key)
    flags = ["--model-path", str(llama_dir), "--tp", "2", "--nnodes", "2", "--dist-init-addr",
             f"127.0.0.1:{free_port()}", "--max-total-tokens", "2048", "--context-length", "512"]
    node1 = HeadlessNode([*flags, "--cluster-key-file", keys[1]])
    try:
        with ServerProcess(*flags, "--cluster-key-file", keys[0], "--node-rank", "0", healthy=False) as node0:
            assert node0.wait_log("CURVE handshake failed", 120), node0.log()
            assert "refused" in node0.log() and node0.get("/health").status_code == 503
            # node 1's side of the handshake fails too; under load its line may come a while after node 0's
            assert wait_until(lambda: "CURVE handshake failed" in node1.log(), 120), node1.log()
    finally:
        node1.stop()


def test_multinode_flags():
    with pytest.raises(ConfigError, match="--dist-init-addr"):
        ServerConfig(nnodes=2, tp=2)
    with pytest.raises(ConfigError, match="HOST:PORT"):
        ServerConfig(nnodes=2, tp=2, dist_init_addr="node0")
    config = ServerConfig(nnodes=2, tp=2, node_rank=1, dist_init_addr="10.0.0.1:29500", cluster_key_file="/k")
    assert config.node_rank == 1


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rank_fed_its_part_keeps_what_it_cuts_from_the_whole(llama_dir, adapter_dirs, dtype):
    # Column-parallel (fused q/k/v with GQA's kv rows, gate/up): B's rows cut; row-parallel (o, down): A's columns.
    config, specs, buffers = read_adapter_dir(str(adapter_dirs["a64"]), root=None)
    model_config = ModelConfig.from_dir(str(llama_dir))
    assert model_config.num_kv_heads < model_config.num_heads  # k_proj/v_proj's B is cut on the kv heads' rows
    pool = PoolSpec(max_lora_rank=64, target_modules=TARGET_MODULES, dtype=dtype, device=torch.device("cpu"))
    parts = cut_per_rank(specs, buffers, 2)
    for tp_rank in (0, 1):
        from_whole = load_adapter(str(adapter_dirs["a64"]), 5, model_config, pool, tp_rank, 2)
        from_part = adapter_from_tensors(config, specs, parts[tp_rank], 5, model_config, pool, tp_rank, 2, is_cut=True)
        assert from_part.weights.keys() == from_whole.weights.keys()
        for key, (lora_a, lora_b) in from_whole.weights.items():
            part_a, part_b = from_part.weights[key]
            assert part_a.shape == lora_a.shape and part_b.shape == lora_b.shape, key
            assert torch.equal(part_a, lora_a) and torch.equal(part_b, lora_b), key  # byte-identical
        sent = sum(frame.nbytes for frame in parts[tp_rank])
        assert sent == rank_bytes(adapter_dirs["a64"], tp_rank, 2)[0] < sum(b.nbytes for b in buffers)


def test_a_cut_load_refuses_bad_tensors_by_their_whole_shape(llama_dir, adapter_dirs):
    config, specs, buffers = read_adapter_dir(str(adapter_dirs["a16"]), root=None)
    model_config = ModelConfig.from_dir(str(llama_dir))
    pool = PoolSpec(max_lora_rank=16, target_modules=TARGET_MODULES, dtype=torch.float32, device=torch.device("cpu"))
    b_index = next(i for i, s in enumerate(specs) if s.name.endswith("q_proj.lora_B.weight"))
    b_spec = specs[b_index]
    rows, lora_rank = b_spec.shape
    wrong = list(specs)  # a B with one row too many: rank 0's cut then has the right size, its whole shape does not
    wrong[b_index] = TensorSpec(name=b_spec.name, dtype=b_spec.dtype, shape=[rows + 1, lora_rank])
    grown = list(buffers)
    grown[b_index] = memoryview(bytes(len(buffers[b_index]) + lora_rank * TENSOR_DTYPES[b_spec.dtype]))
    with pytest.raises(AdapterLoadError, match="shape mismatch with the base model"):
        adapter_from_tensors(config, wrong, cut_per_rank(wrong, grown, 2)[0], 7, model_config, pool, 0, 2, is_cut=True)
    short = list(buffers)  # bytes that do not match the spec go whole, and the rank refuses them on their size
    short[b_index] = buffers[b_index][:-4]
    with pytest.raises(AdapterLoadError, match="rank 1's part of shape"):
        adapter_from_tensors(config, specs, cut_per_rank(specs, short, 2)[1], 7, model_config, pool, 1, 2, is_cut=True)


def test_the_scheduler_gives_each_rank_its_run_of_frames():
    adapters = [AdapterToLoad(lora_id=1, lora_name="x", lora_path="/p")]
    cut = LoadAdapters(op_id=1, adapters=adapters, frames_per_rank=True)
    assert [frames_of_rank(cut, ["a0", "b0", "a1", "b1"], rank, 2) for rank in (0, 1)] == [["a0", "b0"], ["a1", "b1"]]
    assert frames_of_rank(cut, ["a0", "b0", "a1"], 1, 2) == []  # malformed: the rank refuses the count
    whole = LoadAdapters(op_id=2, adapters=adapters)
    assert frames_of_rank(whole, ["a", "b"], 1, 2) == ["a", "b"]
