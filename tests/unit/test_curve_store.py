"""The rendezvous store behind the cluster key (protocol/curve_store.py): the same answers as torch's TCPStore for
the same operations, nothing for a peer without the key (refused, logged, the store unchanged), and a torch
process group made through it."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from loraplex.protocol.curve import ClusterKey, write_key_file
from loraplex.protocol.curve_store import CurveStoreClient, CurveStoreServer, StoreError, torch_store

from tests.net import free_port


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    write_key_file(str(folder / "cluster.key"))
    write_key_file(str(folder / "other.key"))
    return ClusterKey.load(str(folder / "cluster.key")), ClusterKey.load(str(folder / "other.key"))


@pytest.fixture(scope="module")
def store(keys):
    port = free_port()
    server = CurveStoreServer("127.0.0.1", port, keys[0])
    client = CurveStoreClient("127.0.0.1", port, keys[0], timeout=timedelta(seconds=10))
    yield port, client
    client.close()
    server.close()


def run_ops(store) -> list:
    """One sequence of the operations the rendezvous uses, with what each returns (get as bytes)."""
    return [
        store.set("a", b"1"),
        store.get("a"),
        store.add("n", 2),
        store.add("n", 3),
        store.get("n"),
        store.check(["a", "n"]),
        store.check(["a", "missing"]),
        store.compare_set("a", b"1", b"2"),
        store.compare_set("a", b"1", b"3"),  # not the value: unchanged, the current value back
        store.compare_set("c", b"", b"new"),  # absent and expected empty: set
        store.get("a"),
        store.delete_key("c"),
        store.delete_key("c"),
        store.num_keys(),
    ]


def test_same_answers_as_torchs_tcpstore(store):
    _, client = store
    reference = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=10))
    expected = run_ops(reference)
    client.delete_key("a"), client.delete_key("n")
    assert run_ops(client) == expected


def test_get_waits_for_the_key_and_times_out(store):
    port, client = store
    client.set_timeout(timedelta(seconds=0.5))
    started = time.monotonic()
    with pytest.raises(StoreError, match="not set"):
        client.get("never")
    assert 0.5 <= time.monotonic() - started < 5
    client.set_timeout(timedelta(seconds=10))


def test_a_peer_without_the_key_gets_nothing(store, keys, caplog):
    port, client = store
    client.set("secret", b"endpoints")
    with caplog.at_level(logging.WARNING, logger="loraplex.curve"):
        stranger = CurveStoreClient("127.0.0.1", port, keys[1], timeout=timedelta(seconds=1))
        for call in (lambda: stranger.get("secret"), lambda: stranger.set("secret", b"x"),
                     lambda: stranger.add("beats", 1)):
            with pytest.raises(StoreError, match="did not answer"):
                call()
        stranger.close()
        deadline = time.monotonic() + 10
        while "CURVE handshake failed" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "CURVE handshake failed" in caplog.text  # the store logged the refusal
    assert client.get("secret") == b"endpoints" and not client.check(["beats"])


def test_a_process_group_made_through_it(store, keys):
    port, _ = store
    client = CurveStoreClient("127.0.0.1", port, keys[0], timeout=timedelta(seconds=30))
    before = client.num_keys()
    dist.init_process_group("gloo", store=dist.PrefixStore("unit/", torch_store(client)), world_size=1, rank=0)
    try:
        tensor = torch.arange(4.0)
        dist.all_reduce(tensor)
        assert torch.equal(tensor, torch.arange(4.0))
        assert client.num_keys() > before  # the group's rendezvous went through this store
    finally:
        dist.destroy_process_group()
