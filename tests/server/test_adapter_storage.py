"""Adapters from storage end to end: Hub repo ids (against a local stand-in for the Hub's file endpoints) and s3://
prefixes (against moto's S3 server), loaded through both APIs and the resolvers (s3:// and hf://org), equal a
directory load; a second load reads the cache; a cut download leaves nothing behind; a wrong revision or a missing
bucket is a 4xx."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.hub_standin import COMMIT, HubStandIn, hub_env
from tests.hub_standin import dir_files as _files
from tests.server.test_adapter_control import LORA_FLAGS, gen, load
from tests.server_utils import ServerProcess, free_port

AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def storage(llama_dir, adapter_dirs, tmp_path_factory):
    from moto.server import ThreadedMotoServer

    tmp = tmp_path_factory.mktemp("storage")
    adapter = adapter_dirs["a16"]
    root = tmp / "root"  # --lora-path-root: the directory load lives here, the cache elsewhere
    shutil.copytree(adapter, root / "a16")
    hub = HubStandIn({"org/a16": _files(adapter), "org/cut": _files(adapter)}).start()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port())
    moto.start()
    s3_url = f"http://127.0.0.1:{moto._port}"
    try:
        import boto3

        s3 = boto3.client("s3", endpoint_url=s3_url, **_boto_kwargs())
        s3.create_bucket(Bucket="bucket")
        for prefix in ("adapters/a16", "resolver/a16"):
            for name, data in _files(adapter).items():
                s3.put_object(Bucket="bucket", Key=f"{prefix}/{name}", Body=data)
        env = {**hub_env(hub, tmp / "hf-home"), "AWS_ENDPOINT_URL": s3_url, **AWS_ENV}
        cache = tmp / "cache"
        with ServerProcess("--model-path", str(llama_dir), *LORA_FLAGS, "--lora-path-root", str(root),
                           "--lora-cache-dir", str(cache), "--lora-resolver-dir", "s3://bucket/resolver",
                           "--max-loaded-loras", "2", env=env) as server:
            yield server, hub, root / "a16", cache
    finally:
        hub.shutdown()
        moto.stop()


def _boto_kwargs() -> dict[str, str]:
    return {"aws_access_key_id": AWS_ENV["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": AWS_ENV["AWS_SECRET_ACCESS_KEY"], "region_name": AWS_ENV["AWS_DEFAULT_REGION"]}


def _outputs(server, name):
    resp = gen(server, name)
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


def test_hub_and_s3_loads_through_both_apis_and_the_resolver_equal_a_directory_load(storage):
    server, hub, local_dir, cache = storage
    assert load(server, "dir", local_dir).status_code == 200
    expected = _outputs(server, "dir")
    assert expected != _outputs(server, None)  # the adapter changes the output, so equality below means something

    loads = [("hub", "org/a16", ""), ("hub_v1", "hf://org/a16@main", "/v1"), ("hub_commit", f"org/a16@{COMMIT}", ""),
             ("s3", "s3://bucket/adapters/a16", ""), ("s3_v1", "s3://bucket/adapters/a16/", "/v1")]
    for name, path, prefix in loads:
        resp = load(server, name, path, path_prefix=prefix)
        assert resp.status_code == 200, resp.text
        assert _outputs(server, name) == expected, name
    # the resolver's first use of an unknown name: s3://bucket/resolver/a16
    assert _outputs(server, "a16") == expected
    resp = server.post("/v1/completions", {"model": "a16", "prompt": "Hi", "max_tokens": 2})
    assert resp.status_code == 200, resp.text

    # Each file came once from the Hub; later loads of that commit, and the second S3 load, read the cache.
    assert hub.downloads["org/a16"] == len(_files(local_dir))
    assert server.log().count("adapter cache hit: s3://bucket/adapters/a16") == 1
    rows = {row["lora_name"]: row for row in server.get("/lora_adapters").json()["adapters"]}
    assert rows["hub"]["lora_path"] == "org/a16" and rows["a16"]["lora_path"] == "s3://bucket/resolver/a16"
    assert len(os.listdir(cache / "hf")) == 1 and len(os.listdir(cache / "s3")) == 2

    # --max-loaded-loras 2 dropped most host copies: each comes back from its path, through the cache
    for name, _, _ in loads:
        assert _outputs(server, name) == expected, name
    assert hub.downloads["org/a16"] == len(_files(local_dir))


def test_wrong_revision_missing_repo_or_bucket_is_a_clear_4xx(storage):
    server = storage[0]
    cases = [("org/a16@v9", "no revision 'v9'"), ("org/missing", "not found"),
             ("s3://no-such-bucket/x", "NoSuchBucket"), ("s3://bucket/nothing-here", "no adapter_config.json")]
    for path, words in cases:
        for prefix, status in (("", 400), ("/v1", 404)):
            resp = load(server, "bad", path, path_prefix=prefix)
            assert resp.status_code == status, (path, resp.text)
            assert words in resp.text and "'bad'" in resp.text, resp.text
    assert gen(server, "unknown").status_code == 400  # not under the resolver's prefix: the unknown-model answer
    assert server.post("/v1/completions", {"model": "unknown", "prompt": "Hi"}).status_code == 404


def test_a_cut_download_leaves_nothing_usable_and_a_retry_succeeds(storage):
    server, hub, local_dir, cache = storage
    expected = _outputs(server, "dir")
    hub.cut.add("org/cut")
    resp = load(server, "cut", "org/cut")
    assert resp.status_code == 503 and "download failed" in resp.text, resp.text
    assert not [name for name in os.listdir(cache / "hf") if name.startswith("org--cut")]
    assert os.listdir(cache / ".tmp") == []
    assert "cut" not in server.get("/lora_adapters").text

    hub.cut.clear()
    resp = load(server, "cut", "org/cut")
    assert resp.status_code == 200, resp.text
    assert _outputs(server, "cut") == expected


@pytest.fixture(scope="module")
def hub_resolver(llama_dir, adapter_dirs, tmp_path_factory):
    """A server whose --lora-resolver-dir is hf://org, against the Hub stand-in, with directory loads to compare."""
    tmp = tmp_path_factory.mktemp("hub-resolver")
    hub = HubStandIn({"org/a16": _files(adapter_dirs["a16"]), "org/a8": _files(adapter_dirs["a8"])}).start()
    env = hub_env(hub, tmp / "hf-home")
    try:
        with ServerProcess("--model-path", str(llama_dir), *LORA_FLAGS, "--lora-paths",
                           f"dir16={adapter_dirs['a16']}", f"dir8={adapter_dirs['a8']}", "--lora-cache-dir",
                           str(tmp / "cache"), "--lora-resolver-dir", "hf://org", env=env) as server:
            yield server, hub, tmp / "cache"
    finally:
        hub.shutdown()


def test_resolver_on_the_hub_loads_org_name_on_first_use(hub_resolver, adapter_dirs):
    server, hub, cache = hub_resolver
    expected = _outputs(server, "dir16")
    assert expected != _outputs(server, None)
    assert {r["lora_name"] for r in server.get("/lora_adapters").json()["adapters"]} == {"dir16", "dir8"}
    # native: a16 is not loaded, so the resolver fetches the repo org/a16 into the cache and loads it
    assert _outputs(server, "a16") == expected
    assert hub.downloads["org/a16"] == len(_files(adapter_dirs["a16"]))
    row = {r["lora_name"]: r for r in server.get("/lora_adapters").json()["adapters"]}["a16"]
    assert row["lora_path"] == "hf://org/a16"
    assert [name for name in os.listdir(cache / "hf") if name.startswith("org--a16")]
    assert _outputs(server, "a16") == expected and hub.downloads["org/a16"] == len(_files(adapter_dirs["a16"]))
    # OpenAI: the first use of a8 comes from org/a8, and answers as its directory load does
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    first = server.post("/v1/completions", {"model": "a8", **body})
    assert first.status_code == 200, first.text
    assert first.json()["model"] == "a8"
    direct = server.post("/v1/completions", {"model": "dir8", **body}).json()
    assert first.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    assert hub.downloads["org/a8"] == len(_files(adapter_dirs["a8"]))
    # a repo or revision the Hub does not have: a clear 4xx naming it, and nothing loaded
    for name, words in (("missing", "not found"), ("a16@v9", "no revision 'v9'")):
        resp = gen(server, name)
        assert resp.status_code == 400 and words in resp.text and repr(name) in resp.text, resp.text
        resp = server.post("/v1/completions", {"model": name, **body})
        assert resp.status_code == 404 and words in resp.text, resp.text
        assert name not in {r["lora_name"] for r in server.get("/lora_adapters").json()["adapters"]}
