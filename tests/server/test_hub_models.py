"""`loraplex serve org/tiny`: base models by their Hub id, against the local Hub stand-in (tests/hub_standin.py).

The tiny test model is published there in two revisions with different weights, gated, sharded, and with only .bin
weights. Served by id it answers as the same checkpoint served from its directory (base and adapter); a second start
reads the cache and fetches no file; --revision picks its weights; an HF-cache snapshot directory is known by its repo
id and commit; a server stopped mid-download starts again without fetching its finished files again; each failure is
one line and a non-zero exit within 30 s, with no file under a final name."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from tests.hub_standin import HubStandIn, dir_files, hub_env
from tests.server_utils import LAUNCH, ServerProcess, free_port

BODY = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
SMALL = ("--max-total-tokens", "4096", "--context-length", "2048")
LORA = ("--enable-lora", "--max-lora-rank", "64", "--lora-target-modules", "all")


def sharded(model_dir: Path, out: Path) -> dict[str, bytes]:
    """The checkpoint's files with its weights cut into two shards and an index (the second shard the larger)."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 4],
              "model-00002-of-00002.safetensors": names[len(names) // 4:]}
    out.mkdir()
    files = {n: d for n, d in dir_files(model_dir).items() if n != "model.safetensors"}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(out / shard), metadata={"format": "pt"})
        files[shard] = (out / shard).read_bytes()
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    return files


@pytest.fixture(scope="module")
def hub(llama_dir, adapter_dirs, tmp_path_factory):
    from tests.builders import build_tiny_model

    tmp = tmp_path_factory.mktemp("hub-models")
    build_tiny_model(tmp / "v2", arch="llama", seed=1)  # same shapes and tokenizer, other weights
    server = HubStandIn().start()
    server.publish("org/tiny", dir_files(llama_dir))
    server.publish("org/tiny", dir_files(tmp / "v2"), revision="v2")
    adapter = dir_files(adapter_dirs["a16"])  # a Hub adapter names its Hub base model
    adapter_config = json.loads(adapter["adapter_config.json"])
    adapter["adapter_config.json"] = json.dumps({**adapter_config, "base_model_name_or_path": "org/tiny"}).encode()
    server.publish("org/tiny-adapter", adapter)
    server.publish("org/gated", dir_files(llama_dir), token="secret")
    files = dir_files(llama_dir)
    files["pytorch_model.bin"] = files.pop("model.safetensors")
    server.publish("org/bin-only", files)
    server.publish("org/sharded", sharded(llama_dir, tmp / "sharded"))
    yield server, tmp
    server.shutdown()


def completion(server: ServerProcess, model: str) -> str:
    resp = server.post("/v1/completions", {"model": model, **BODY})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def full_log(server: ServerProcess) -> str:
    return Path(server.log_path).read_text()


def files_in_cache(cache: Path) -> dict[str, bytes]:
    """Every file under a final name in the cache (snapshots resolved) -> its bytes."""
    return {str(p.relative_to(cache)): p.read_bytes() for p in cache.rglob("*")
            if p.is_file() and ("snapshots" in p.parts or "blobs" in p.parts) and not p.name.endswith(".incomplete")}


def test_a_hub_id_serves_as_its_directory_once_downloaded_and_then_from_the_cache(hub, llama_dir, adapter_dirs,
                                                                                   tmp_path):
    stand_in, _ = hub
    env = hub_env(stand_in, tmp_path / "hf-home")
    adapter_cache = ("--lora-cache-dir", str(tmp_path / "adapters"))
    with ServerProcess("--model-path", str(llama_dir), *LORA, *SMALL, "--lora-modules",
                       f"a={adapter_dirs['a16']}") as server:
        expected = {model: completion(server, model) for model in (llama_dir.name, "a")}
    assert expected[llama_dir.name] != expected["a"]  # the adapter changes the answer: equality below means something

    commit = stand_in.repos["org/tiny"].refs["main"]
    before = len(stand_in.file_gets)
    with ServerProcess(*LORA, *SMALL, "--lora-modules", "a=org/tiny-adapter", *adapter_cache,
                       argv_prefix=("serve", "org/tiny"), env=env) as server:
        assert completion(server, "org/tiny") == expected[llama_dir.name]
        assert completion(server, "a") == expected["a"]
        assert [card["id"] for card in server.get("/v1/models").json()["data"]] == ["org/tiny", "a"]
        info = server.get("/server_info").json()
        assert (info["model_path"], info["served_model_name"], info["revision"]) == ("org/tiny", "org/tiny", commit)
        assert info["model_dir"] == str(tmp_path / "hf-home" / "hub" / "models--org--tiny" / "snapshots" / commit)
        log = full_log(server)
    fetched = sorted(name for repo, name, _ in stand_in.file_gets[before:] if repo == "org/tiny")
    assert fetched == sorted(dir_files(llama_dir)), fetched  # each file once, nothing else
    assert log.count("downloading 7 files") == 1 and "model.safetensors (" in log  # a line per file (no terminal)

    gets = len(stand_in.file_gets)
    with ServerProcess(*SMALL, argv_prefix=("serve", "org/tiny"), env=env) as server:  # the cache, no file fetched
        assert completion(server, "org/tiny") == expected[llama_dir.name]
        assert "all 7 files in the cache" in full_log(server)
    assert len(stand_in.file_gets) == gets

    # the snapshot directory itself, offline: known by its repo id and commit
    snapshot = tmp_path / "hf-home" / "hub" / "models--org--tiny" / "snapshots" / commit
    with ServerProcess("--model-path", str(snapshot), *SMALL, env={**env, "HF_HUB_OFFLINE": "1"}) as server:
        assert [card["id"] for card in server.get("/v1/models").json()["data"]] == ["org/tiny"]
        info = server.get("/server_info").json()
        assert (info["model_path"], info["revision"]) == (str(snapshot), commit)
        assert completion(server, "org/tiny") == expected[llama_dir.name]
    assert len(stand_in.file_gets) == gets


def test_revision_picks_its_weights(hub, tmp_path):
    stand_in, _ = hub
    env = hub_env(stand_in, tmp_path / "hf-home")
    answers = {}
    # v2 differs from main in its weights only: its other files are main's blobs, in the cache already
    for revision, tp, num_fetched in (("main", "2", 7), ("v2", "1", 1)):
        before = len(stand_in.file_gets)
        with ServerProcess("--model-path", "org/tiny", "--revision", revision, "--tp", tp, *SMALL, env=env) as server:
            answers[revision] = completion(server, "org/tiny")
            assert server.get("/server_info").json()["revision"] == stand_in.repos["org/tiny"].refs[revision]
            assert full_log(server).count("downloading 7 files") == 1
        assert len(stand_in.file_gets) - before == num_fetched  # once per machine, whatever --tp says
    assert answers["main"] != answers["v2"]
    with ServerProcess("--model-path", "org/tiny@v2", *SMALL, env={**env, "HF_HUB_OFFLINE": "1"}) as server:
        assert completion(server, "org/tiny") == answers["v2"]  # offline: the cached ref v2


def test_a_server_stopped_mid_download_starts_again_without_refetching_finished_files(hub, llama_dir, tmp_path):
    stand_in, _ = hub
    env = {**hub_env(stand_in, tmp_path / "hf-home"), "HF_HUB_DOWNLOAD_TIMEOUT": "60"}
    cache = tmp_path / "hf-home" / "hub"
    big = "model-00002-of-00002.safetensors"
    files = stand_in.repos["org/sharded"].commits[stand_in.repos["org/sharded"].refs["main"]]
    stand_in.stalled.clear()
    stand_in.stall_after[big] = len(files[big]) // 2
    before = len(stand_in.file_gets)
    server = ServerProcess("--model-path", "org/sharded", *SMALL, env=env, healthy=False)
    try:
        assert stand_in.stalled.wait(60), server.log()
        server.stop()  # SIGTERM mid-file
    finally:
        server.stop()
        del stand_in.stall_after[big]
    assert "stopped while fetching the model" in full_log(server)
    first = [name for repo, name, _ in stand_in.file_gets[before:] if repo == "org/sharded"]
    assert first[-1] == big and "model-00001-of-00002.safetensors" in first
    on_disk = files_in_cache(cache)
    assert not [p for p in on_disk if p.endswith(big)]  # the cut file is under no final name
    for path, data in on_disk.items():  # what is there is whole
        if "snapshots" in path:
            assert data == files[Path(path).name], path
    assert not list(cache.rglob("*.incomplete"))  # stopped by SIGTERM, the partial file is removed

    with ServerProcess("--model-path", "org/sharded", *SMALL, env=env) as server:
        assert completion(server, "org/sharded")
    second = [name for repo, name, _ in stand_in.file_gets[before:] if repo == "org/sharded"][len(first):]
    assert second == [big]  # only the file that was cut
    with ServerProcess("--model-path", str(llama_dir), *SMALL) as server:
        reference = completion(server, llama_dir.name)
    with ServerProcess("--model-path", "org/sharded", *SMALL, env={**env, "HF_HUB_OFFLINE": "1"}) as server:
        assert completion(server, "org/sharded") == reference  # the shards make the same checkpoint


@pytest.mark.parametrize("argv, extra_env, words", [
    (["serve", "org/gated"], {}, "org/gated is gated: accept its terms at"),
    (["serve", "org/gated", "--hf-token", "wrong"], {}, "the token given has no access"),
    (["serve", "org/tiny", "--revision", "v9"], {}, "Hub repo org/tiny has no revision 'v9'"),
    (["serve", "org/missing"], {}, "no Hub repo org/missing (nor a local directory of that name)"),
    (["serve", "org/bin-only"], {}, "org/bin-only has no .safetensors weights (it has pytorch_model.bin)"),
    (["serve", "org/tiny"], {"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE=1 and org/tiny is not in the cache"),
], ids=["gated", "wrong-token", "revision", "repo", "bin-only", "offline"])
def test_each_failure_is_one_line_and_a_nonzero_exit_within_30_s(hub, tmp_path, argv, extra_env, words):
    stand_in, _ = hub
    env = {**os.environ, **hub_env(stand_in, tmp_path / "hf-home"), **extra_env}
    start = time.monotonic()
    done = subprocess.run([*LAUNCH, *argv,
                           "--port", str(free_port()), "--device", "cpu"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert time.monotonic() - start < 30
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert done.returncode != 0 and len(errors) == 1 and words in errors[0], done.stderr
    assert errors[0].startswith("loraplex: error: ")
    assert files_in_cache(tmp_path / "hf-home") == {}


def test_the_right_token_opens_the_gated_repo(hub, llama_dir, tmp_path):
    stand_in, _ = hub
    env = hub_env(stand_in, tmp_path / "hf-home")
    with ServerProcess(*SMALL, argv_prefix=("serve", "org/gated"), env={**env, "HF_TOKEN": "secret"}) as server:
        assert server.get("/server_info").json()["hf_token"] is None and completion(server, "org/gated")
    with ServerProcess("--hf-token", "secret", *SMALL, argv_prefix=("serve", "org/gated"),
                       env={**env, "HF_HOME": str(tmp_path / "other")}) as server:
        assert server.get("/server_info").json()["hf_token"] == "***"  # never shown


def test_nodes_download_each_and_must_serve_one_commit(hub, tmp_path):
    from loraplex.protocol.curve import write_key_file

    stand_in, _ = hub
    write_key_file(str(tmp_path / "cluster.key"))

    def node(rank: int, revision: str, addr: str) -> subprocess.Popen:
        env = {**os.environ, **hub_env(stand_in, tmp_path / f"hf-node{rank}")}  # each node its own cache
        argv = ["--cluster-key-file", str(tmp_path / "cluster.key"), "--model-path", "org/tiny", "--revision",
                revision, "--tp", "2", "--nnodes", "2", "--dist-init-addr", addr, "--node-rank", str(rank),
                "--max-total-tokens", "2048", "--context-length", "512", "--device", "cpu", "--port", str(free_port())]
        return subprocess.Popen([*LAUNCH, *argv],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

    v2 = stand_in.repos["org/tiny"].refs["v2"]
    nodes = [node(1, "v2", addr := f"127.0.0.1:{free_port()}"), node(0, "main", addr)]
    try:
        errors = [proc.communicate(timeout=120)[1] for proc in nodes]
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    for proc, stderr in zip(nodes, errors, strict=True):
        last = stderr.strip().splitlines()[-1]
        assert proc.returncode != 0 and last.startswith("loraplex: error: node "), stderr
        assert f"at {v2}" in last or f"commit {v2}" in last, last
        assert "give every node the same --revision" in last, last

    # the same revision: each node downloads its copy, the commits agree, node 0 serves
    main = stand_in.repos["org/tiny"].refs["main"]
    addr = f"127.0.0.1:{free_port()}"
    flags = ("--cluster-key-file", str(tmp_path / "cluster.key"), "--tp", "2", "--nnodes", "2", "--dist-init-addr",
             addr, "--max-total-tokens", "2048", "--context-length", "512")
    node1 = subprocess.Popen([*LAUNCH, "--model-path",
                              "org/tiny", *flags, "--node-rank", "1", "--device", "cpu", "--port", str(free_port())],
                             env={**os.environ, **hub_env(stand_in, tmp_path / "hf-node1")},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        with ServerProcess("--model-path", "org/tiny", *flags, "--node-rank", "0",
                           env=hub_env(stand_in, tmp_path / "hf-node0")) as server:
            assert server.get("/server_info").json()["revision"] == main
            assert completion(server, "org/tiny")
        for rank in (0, 1):
            assert (tmp_path / f"hf-node{rank}" / "hub" / "models--org--tiny" / "snapshots" / main).is_dir()
    finally:
        os.killpg(node1.pid, 9)
        node1.wait()
