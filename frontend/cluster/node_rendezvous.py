"""NodeRendezvous: how the nodes of a multi-node server (--nnodes) find and watch each other.

Node 0's frontend hosts the rendezvous store at --dist-init-addr, the one address the nodes agree on: a key-value
store over the cluster key's CURVE channel (protocol/curve_store.py), so only holders of --cluster-key-file read or
write it. The ranks join their process group through it too (worker/dist.py). Every other internal endpoint is
picked free by the node that binds it and published there: node 0 the scheduler's TCP socket for the ranks' replies,
every other node its ranks' batch and loader sockets. Liveness goes through the same store: each headless node bumps
a beat counter; node 0 calls a node dead when its counter stands still for NODE_TIMEOUT_S, and writes `failed` when
it stops serving, which the headless nodes read (a store they cannot reach means node 0 is gone). Each node's
launcher resolved (and downloaded) the model itself: the nodes publish the commit they serve, and a node whose
commit differs from node 0's stops the start on both sides with one line.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from datetime import timedelta

import msgspec
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.curve import ClusterKey
from loraplex.protocol.curve_store import CurveStoreClient, CurveStoreServer
from loraplex.protocol.structs import Endpoints

logger = logging.getLogger("loraplex.nodes")

NODE_TIMEOUT_S = 5.0  # a headless node whose beat stands still this long is dead (node 0's /health: 503 within 10 s)
BEAT_INTERVAL_S = 0.5
STORE_OP_TIMEOUT = timedelta(seconds=5)  # a store operation that outlasts this means the other side is gone
PREFIX = "loraplex/"
LORA_POOL_FIELDS = ("enable_lora", "max_lora_rank", "lora_target_modules", "max_loras_per_batch")


def split_addr(addr: str) -> tuple[str, int]:
    host, port = addr.rsplit(":", 1)
    return host.strip("[]"), int(port)


def free_tcp_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def own_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to host (no packet is sent: a UDP connect only picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        return sock.getsockname()[0]


class NodeRendezvous:
    def __init__(self, config: ServerConfig, start_timeout_s: float, model_revision: str | None = None):
        self.config = config
        self.model_revision = model_revision  # the commit this node's launcher resolved; None for a plain directory
        self.host, self.port = split_addr(config.dist_init_addr)
        key = ClusterKey.load(config.cluster_key_file)  # required with --nnodes > 1 (ServerConfig checks)
        is_master = config.node_rank == 0
        logger.info("%s the node store at %s:%d", "hosting" if is_master else "joining", self.host, self.port)
        self.server = CurveStoreServer(self.host, self.port, key) if is_master else None
        # The first call waits for node 0 (a headless node usually starts first); later ones fail fast.
        self.store = CurveStoreClient(self.host, self.port, key, timeout=timedelta(seconds=start_timeout_s))
        self.store.num_keys()
        self.store.set_timeout(STORE_OP_TIMEOUT)
        self._beats: dict[int, tuple[int, float]] = {}  # node 0: node -> (last count seen, when it changed)

    # ---- endpoints ---------------------------------------------------------------------------------------

    def host_endpoints(self, ipc_dir: str, start_timeout_s: float) -> Endpoints:
        """Node 0: the scheduler's endpoints over every rank (node 0's ranks local, the others' as published)."""
        local_ranks = self.config.tp // self.config.nnodes
        reply_addr = f"tcp://{self.host}:{free_tcp_port(self.host)}"
        # The LoRA pool as node 0 resolved it (perhaps from adapters only node 0 reads): every rank sizes it alike.
        pool = {name: getattr(self.config, name) for name in LORA_POOL_FIELDS}
        self.store.set(PREFIX + "node0", json.dumps({"workers_to_scheduler": reply_addr, "lora_pool": pool,
                                                     "revision": self.model_revision}))
        to_workers = [f"ipc://{ipc_dir}/dp0_to_worker{i}" for i in range(local_ranks)]
        to_loaders = [f"ipc://{ipc_dir}/dp0_to_loader{i}" for i in range(local_ranks)]
        for node in range(1, self.config.nnodes):
            published = json.loads(self._wait_key(f"node{node}", start_timeout_s))
            self._check_revision(node, published.get("revision"))
            to_workers += published["scheduler_to_workers"]
            to_loaders += published["scheduler_to_loaders"]
            self._beats[node] = (0, time.monotonic())
        return Endpoints(
            frontend_to_scheduler=f"ipc://{ipc_dir}/dp0_to_scheduler",
            scheduler_to_frontend=f"ipc://{ipc_dir}/dp0_to_frontend",
            scheduler_to_workers=to_workers,
            workers_to_scheduler=reply_addr,
            scheduler_to_loaders=to_loaders,
            dist_init_addr=self.config.dist_init_addr,
        )

    def join_endpoints(self, start_timeout_s: float) -> tuple[Endpoints, ServerConfig]:
        """A headless node: its ranks' sockets, bound on its own address towards node 0 and published for node 0; and
        the configuration its ranks run, with node 0's LoRA pool."""
        local_ranks = self.config.tp // self.config.nnodes
        own = own_address_towards(self.host, self.port)
        to_workers = [f"tcp://{own}:{free_tcp_port(own)}" for _ in range(local_ranks)]
        to_loaders = [f"tcp://{own}:{free_tcp_port(own)}" for _ in range(local_ranks)]
        published = {"scheduler_to_workers": to_workers, "scheduler_to_loaders": to_loaders,
                     "revision": self.model_revision}
        self.store.set(PREFIX + f"node{self.config.node_rank}", json.dumps(published))
        node0 = json.loads(self._wait_key("node0", start_timeout_s))
        self._check_revision(0, node0.get("revision"))
        endpoints = Endpoints(
            frontend_to_scheduler="",
            scheduler_to_frontend="",
            scheduler_to_workers=to_workers,
            workers_to_scheduler=node0["workers_to_scheduler"],
            scheduler_to_loaders=to_loaders,
            dist_init_addr=self.config.dist_init_addr,
        )
        return endpoints, msgspec.structs.replace(self.config, **node0["lora_pool"])

    def _check_revision(self, node: int, revision: str | None) -> None:
        """Every node serves the same commit of the model (each node's launcher downloaded its own copy); a plain
        directory has no commit to compare."""
        if revision is not None and self.model_revision is not None and revision != self.model_revision:
            raise RuntimeError(f"node {node} serves {self.config.model_path} at commit {revision} and node "
                               f"{self.config.node_rank} at {self.model_revision}: give every node the same "
                               "--revision (a commit)")

    def _wait_key(self, key: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.store.check([PREFIX + key]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{key} did not join through {self.config.dist_init_addr} within {timeout_s:.0f} s")
            time.sleep(0.1)
        return self.store.get(PREFIX + key).decode()

    # ---- liveness ---------------------------------------------------------------------------------------------

    def dead_node(self) -> str | None:
        """Node 0: the first headless node whose beat stood still for NODE_TIMEOUT_S, if any."""
        now = time.monotonic()
        for node, (count, changed_at) in self._beats.items():
            current = self.store.add(PREFIX + f"node{node}/beats", 0)
            if current != count:
                self._beats[node] = (current, now)
            elif now - changed_at > NODE_TIMEOUT_S:
                return f"node {node} (no heartbeat for {now - changed_at:.1f} s)"
        return None

    def set_ready(self) -> None:
        self.store.set(PREFIX + "ready", "1")

    def set_failed(self, reason: str) -> None:
        try:
            self.store.set(PREFIX + "failed", reason)
        except Exception:  # noqa: BLE001 - best effort: a headless node also sees its batches stop
            logger.warning("could not tell the other nodes that this server failed")

    def beat(self) -> tuple[bool, str | None]:
        """A headless node's beat: (node 0 ready, why node 0 stopped serving or None). Raises if node 0 is gone."""
        self.store.add(PREFIX + f"node{self.config.node_rank}/beats", 1)
        failed = self.store.get(PREFIX + "failed").decode() if self.store.check([PREFIX + "failed"]) else None
        return self.store.check([PREFIX + "ready"]), failed
