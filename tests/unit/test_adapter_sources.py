"""frontend/adapters/sources.py without a network: which paths are remote, the resolver's remote names, and the
cache's atomic install and size-capped LRU eviction."""

from __future__ import annotations

import os
import time

import pytest
from loraplex.frontend.adapters.sources import AdapterCache, RemoteAdapter, SourceError, parse_remote, resolver_source


def test_remote_paths_are_told_from_local_ones(tmp_path, monkeypatch):
    assert parse_remote("org/name") == RemoteAdapter("hf", "org/name")
    assert parse_remote("org/name@v1.0") == RemoteAdapter("hf", "org/name", "v1.0")
    assert parse_remote("hf://org/name@main") == RemoteAdapter("hf", "org/name", "main")
    assert parse_remote("s3://bucket/some/prefix/") == RemoteAdapter("s3", "bucket/some/prefix")
    assert parse_remote("s3://bucket") == RemoteAdapter("s3", "bucket")
    for local in ("/abs/path", "./rel/path", "one", "a/b/c", str(tmp_path)):
        assert parse_remote(local) is None, local
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_remote("org/name") is None  # a local path of that name wins
    for bad in ("s3://", "hf://just-a-name"):
        with pytest.raises(SourceError):
            parse_remote(bad)


def test_a_remote_resolver_names_adapters_under_it():
    assert resolver_source("s3://bucket/prefix/", "x") == "s3://bucket/prefix/x"
    assert resolver_source("hf://org", "x") == "hf://org/x"
    assert resolver_source("/local/dir", "x") is None


def test_install_is_atomic_and_the_least_recently_used_entries_go_past_the_cap(tmp_path):
    cache = AdapterCache(str(tmp_path / "cache"), max_bytes=250)
    os.makedirs(cache._tmp_root)

    def write(size):
        def download(tmp):
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(b"x" * (size // 2))
        return download

    def broken(tmp):
        write(100)(tmp)
        raise OSError("connection dropped")

    sources = [RemoteAdapter("s3", f"bucket/{i}") for i in range(3)]
    paths = [cache.entry_path(source, "v1") for source in sources]
    with pytest.raises(OSError):
        cache.install(sources[0], paths[0], broken)
    assert not os.path.exists(paths[0]) and os.listdir(cache._tmp_root) == []
    for source, path in zip(sources[:2], paths, strict=False):
        cache.install(source, path, write(100))
        time.sleep(0.01)  # distinct mtimes
    assert cache.hit(sources[0], paths[0])  # used again: now the most recent
    cache.install(sources[2], paths[2], write(100))
    cache._evict(keep=paths[2])
    assert [os.path.isdir(p) for p in paths] == [True, False, True]
    with pytest.raises(SourceError, match="not a LoRA adapter"):
        cache.install(sources[1], paths[1], lambda tmp: None)
