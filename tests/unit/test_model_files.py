"""Models by Hub id, in process: what a model path names (protocol/model_ref.py), the served name and flags
(protocol/config.py), and HubDownload (frontend/model_files.py) against the local Hub stand-in: only the files serving
reads, the cache reused, the free-space check before the first byte, offline from the cache, and each failure one line
with nothing left under a final name. tests/server/test_hub_models.py starts servers on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import namedtuple

import pytest
from loraplex.frontend import model_files
from loraplex.frontend.cluster.node_rendezvous import NodeRendezvous
from loraplex.frontend.entrypoints.cli import parse_command_line
from loraplex.frontend.model_files import HubDownload, ModelFilesError, resolve_model_files
from loraplex.protocol.config import ConfigError, ServerConfig
from loraplex.protocol.model_ref import parse_model_ref

from tests.hub_standin import HubStandIn
from tests.server_utils import REPO_ROOT

SHA = "a" * 40
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = {"metadata": {}, "weight_map": {"x": SHARDS[0], "y": SHARDS[1]}}
REPO = {  # what a Hub checkpoint often holds beside what serving reads
    "config.json": b'{"model_type": "llama"}', "generation_config.json": b'{"g": 1}', "tokenizer.json": b'{"t": 1}',
    "tokenizer_config.json": b'{"t": 2}', "special_tokens_map.json": b'{"s": 1}', "chat_template.jinja": b"{{ x }}",
    "model.safetensors.index.json": json.dumps(INDEX).encode(), "model-00001-of-00002.safetensors": b"1" * 3000,
    "model-00002-of-00002.safetensors": b"2" * 5000, "consolidated.safetensors": b"c" * 8000,
    "pytorch_model.bin": b"b" * 8000, "README.md": b"# card", "preprocessor_config.json": b'{"p": 1}',
    "original/params.json": b'{"o": 1}',
}
SERVED = sorted(set(REPO) - {"consolidated.safetensors", "pytorch_model.bin", "README.md", "original/params.json"})


# ---- what a path names, and the config ---------------------------------------------------------------------


def test_a_path_names_a_hub_id_a_snapshot_or_a_local_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hub = parse_model_ref("org/name@v1")
    assert (hub.repo_id, hub.revision, hub.is_hub) == ("org/name", "v1", True)
    assert parse_model_ref("org/name", "v2").revision == "v2"
    with pytest.raises(ValueError, match="give one"):
        parse_model_ref("org/name@v1", "v2")
    (tmp_path / "org" / "name").mkdir(parents=True)  # a local directory of that name wins
    local = parse_model_ref("org/name")
    assert (local.repo_id, local.revision, local.is_local) == (None, None, True)
    snapshot = tmp_path / "hub" / "models--Org--Na.me" / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    ref = parse_model_ref(str(snapshot))
    assert (ref.repo_id, ref.revision, ref.is_local) == ("Org/Na.me", SHA, True)
    assert parse_model_ref("/no/such/dir").is_local and parse_model_ref("demo").is_local


def test_the_served_name_defaults_to_the_hub_id(tmp_path):
    assert parse_command_line(["serve", "org/tiny@v1"])[0].model_name == "org/tiny"
    assert parse_command_line(["--model-path", "org/tiny", "--served-model-name", "t"])[0].model_name == "t"
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    config = parse_command_line(["--model", str(snapshot)])[0]
    assert (config.model_name, config.model_path) == ("org/tiny", str(snapshot))  # the path as given
    assert parse_command_line(["--model-path", str(tmp_path)])[0].model_name == tmp_path.name


def test_hub_flags_in_our_vllms_and_sglangs_spellings():
    config, notes = parse_command_line(["serve", "org/tiny", "--revision", "v2", "--tokenizer", "org/tok",
                                        "--tokenizer-revision", "t1", "--download-dir", "/d", "--hf-token", "k"])
    assert (config.revision, config.tokenizer, config.tokenizer_revision, config.download_dir, config.hf_token,
            notes) == ("v2", "org/tok", "t1", "/d", "k", [])
    assert config.model_ref.revision == "v2" and config.tokenizer_ref.revision == "t1"
    assert parse_command_line(["--model-path", "org/tiny", "--tokenizer-path", "org/tok"])[0].tokenizer == "org/tok"
    with pytest.raises(ConfigError, match="give one"):
        parse_command_line(["serve", "org/tiny@v1", "--revision", "v2"])
    with pytest.raises(ConfigError, match="--tokenizer-revision needs --tokenizer"):
        parse_command_line(["serve", "org/tiny", "--tokenizer-revision", "t1"])


# ---- downloads -----------------------------------------------------------------------------------------------


@pytest.fixture
def hub(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    server = HubStandIn().start()
    # resolve_model_files reads HF_ENDPOINT as huggingface_hub did at import
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    template = server.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    server.publish("org/model", REPO)
    server.publish("org/gated", REPO, token="secret")
    server.publish("org/bin-only", {n: d for n, d in REPO.items() if not n.endswith(".safetensors")})
    yield server
    server.shutdown()


def download(hub: HubStandIn, cache, repo="org/model", revision=None, token=None) -> tuple[str, str]:
    return HubDownload(repo, revision, str(cache), token, endpoint=hub.url).run()


def final_files(cache) -> dict[str, int]:
    """Every file under a final name in the cache (snapshots and blobs) -> its size."""
    found = {}
    for folder, _, names in os.walk(cache):
        for name in names:
            path = os.path.join(folder, name)
            if "/snapshots/" in path or "/blobs/" in path and not name.endswith(".incomplete"):
                found[os.path.relpath(path, cache)] = os.path.getsize(path)
    return found


def test_only_what_serving_reads_once_then_from_the_cache(hub, tmp_path):
    snapshot, commit = download(hub, tmp_path)
    assert sorted(name for _, name, _ in hub.file_gets) == SERVED
    assert sorted(os.listdir(snapshot)) == SERVED and commit == hub.repos["org/model"].refs["main"]
    for name in SERVED:
        with open(os.path.join(snapshot, name), "rb") as f:
            assert f.read() == REPO[name], name
    assert (tmp_path / "models--org--model" / "refs" / "main").read_text() == commit
    gets = len(hub.file_gets)
    assert download(hub, tmp_path) == (snapshot, commit) and len(hub.file_gets) == gets  # no file fetched again
    assert download(hub, tmp_path, revision=commit) == (snapshot, commit) and len(hub.file_gets) == gets


def test_offline_serves_the_cache_and_names_a_missing_file(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot, commit = download(hub, tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    gets = len(hub.file_gets)
    assert download(hub, tmp_path) == (snapshot, commit) and len(hub.file_gets) == gets
    os.remove(os.path.join(snapshot, "model-00002-of-00002.safetensors"))
    with pytest.raises(ModelFilesError, match="HF_HUB_OFFLINE=1 and model-00002-of-00002.safetensors of org/model"):
        download(hub, tmp_path)
    with pytest.raises(ModelFilesError, match="org/other is not in the cache"):
        download(hub, tmp_path, repo="org/other")


def test_a_revision_picks_its_commit(hub, tmp_path):
    changed = dict(REPO, **{"model-00002-of-00002.safetensors": b"3" * 5000})
    v2 = hub.publish("org/model", changed, revision="v2")
    snapshot, commit = download(hub, tmp_path, revision="v2")
    assert commit == v2 and (tmp_path / "models--org--model" / "refs" / "v2").read_text() == v2
    with open(os.path.join(snapshot, "model-00002-of-00002.safetensors"), "rb") as f:
        assert f.read() == b"3" * 5000


@pytest.mark.parametrize("repo, revision, token, words", [
    ("org/gated", None, None, "org/gated is gated: accept its terms at http"),
    ("org/gated", None, "wrong", "the token given has no access"),
    ("org/model", "v9", None, "has no revision 'v9'"),
    ("org/missing", None, None, "no Hub repo org/missing"),
    ("org/bin-only", None, None, "has no .safetensors weights (it has pytorch_model.bin): loraplex reads safetensors"),
])
def test_each_failure_is_one_line_and_nothing_is_left_under_a_final_name(hub, tmp_path, repo, revision, token, words):
    with pytest.raises(ModelFilesError) as info:
        download(hub, tmp_path, repo=repo, revision=revision, token=token)
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert final_files(tmp_path) == {}
    assert [name for _, name, _ in hub.file_gets if name.endswith(".safetensors")] == []


def test_the_right_token_opens_a_gated_repo(hub, tmp_path):
    snapshot, _ = download(hub, tmp_path, repo="org/gated", token="secret")
    assert sorted(os.listdir(snapshot)) == SERVED


def test_free_space_is_checked_before_the_first_byte(hub, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(model_files.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 4000, 4000))
    with pytest.raises(ModelFilesError, match=r"org/model needs 8.\d KB more and .* has 4.0 KB free: make room"):
        download(hub, tmp_path)
    assert [name for _, name, _ in hub.file_gets if name.endswith(".safetensors")] == []  # only the index came


def test_a_hub_tokenizer_brings_no_weights_and_dummy_weights_need_none(hub, tmp_path):
    hub.publish("org/tok", {n: d for n, d in REPO.items() if n.startswith(("tokenizer", "special", "chat"))})
    config = ServerConfig(model_path="org/model", tokenizer="org/tok", download_dir=str(tmp_path),
                          load_format="dummy")
    files = resolve_model_files(config)
    assert sorted(os.listdir(files.model_dir)) == [n for n in SERVED if not n.startswith("model")]
    assert sorted(os.listdir(files.tokenizer_dir)) == ["chat_template.jinja", "special_tokens_map.json",
                                                        "tokenizer.json", "tokenizer_config.json"]
    assert files.revision == hub.repos["org/model"].refs["main"]


def test_a_revision_for_a_local_directory_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelFilesError, match="is a local directory: give its Hub id instead"):
        resolve_model_files(ServerConfig(model_path=str(tmp_path), revision="v2"))
    assert resolve_model_files(ServerConfig(model_path=str(tmp_path))).revision is None
    with pytest.raises(ModelFilesError, match="no model at '/no/such/dir': expected a directory with config.json"):
        resolve_model_files(ServerConfig(model_path="/no/such/dir"))


def test_two_processes_starting_at_once_on_one_cache_fetch_each_file_once(hub, tmp_path):
    hub.delay_s[SHARDS[1]] = 2.0  # the first to take the file's lock holds it a while; the other waits for it
    script = ("import sys; from loraplex.frontend.model_files import HubDownload; "
              "print(HubDownload('org/model', None, sys.argv[1], None, endpoint=sys.argv[2]).run()[0])")
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), hub.url], env=env, cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    snapshots = {out.strip() for out, _ in outs}
    assert len(snapshots) == 1
    assert sorted(name for _, name, _ in hub.file_gets) == SERVED  # no file came twice
    for name in SERVED:
        with open(os.path.join(next(iter(snapshots)), name), "rb") as f:
            assert f.read() == REPO[name], name
    assert not list(tmp_path.rglob("*.incomplete"))


def test_nodes_serving_different_commits_stop_the_start():
    nodes = NodeRendezvous.__new__(NodeRendezvous)  # the check alone, no store
    nodes.config = ServerConfig(model_path="org/model", node_rank=1, nnodes=2, tp=2, dist_init_addr="127.0.0.1:1",
                                cluster_key_file="/k")
    nodes.model_revision = "a" * 40
    nodes._check_revision(0, "a" * 40)
    nodes._check_revision(0, None)  # a plain directory on node 0: nothing to compare
    with pytest.raises(RuntimeError, match="node 0 serves org/model at commit bbbb.* and node 1 at aaaa"):
        nodes._check_revision(0, "b" * 40)


def test_partial_files_a_killed_start_left_are_removed_and_live_ones_kept(hub, tmp_path):
    blobs = tmp_path / "models--org--model" / "blobs"
    blobs.mkdir(parents=True)
    stale, live = blobs / "0ab.1234abcd.incomplete", blobs / "0cd.5678abcd.incomplete"
    stale.write_bytes(b"x" * 100)
    live.write_bytes(b"y" * 100)
    old = time.time() - model_files.STALE_PARTIAL_S - 60
    os.utime(stale, (old, old))
    download(hub, tmp_path)
    assert not stale.exists() and live.exists()
