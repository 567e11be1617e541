"""Process-level set-up for a rank: its global rank, device, dtype, and the torch.distributed group."""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.curve import ClusterKey
from loraplex.protocol.curve_store import CurveStoreClient, torch_store
from torch.distributed.distributed_c10d import _set_pg_timeout

logger = logging.getLogger(__name__)

DIST_INIT_TIMEOUT = timedelta(minutes=10)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def global_rank(config: ServerConfig, local_rank: int) -> int:
    """Ranks are numbered node by node: node n holds ranks n * (tp / nnodes) ... (n + 1) * (tp / nnodes) - 1."""
    return config.node_rank * ranks_per_node(config) + local_rank


def ranks_per_node(config: ServerConfig) -> int:
    return config.tp // config.nnodes


def pick_device(config: ServerConfig, device_index: int) -> torch.device:
    device_type = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was asked for but CUDA is not available")
        return torch.device("cuda", device_index)
    return torch.device("cpu")


def pick_dtype(config: ServerConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.dtype]


def init_distributed(config: ServerConfig, dist_init_addr: str, rank: int, device: torch.device) -> None:
    """Join the tensor-parallel group (gloo on CPU, nccl on CUDA). Nothing to do for tp == 1."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if config.tp == 1:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    logger.info(
        "joining torch.distributed group: rank %d of %d, %s at tcp://%s", rank, config.tp, backend, dist_init_addr
    )
    if config.dist_interface:
        # The collectives connect rank to rank on their own sockets, outside the cluster key's CURVE channel: they stay
        # on the interface named (a private network). Both backends read these when the group is made.
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = config.dist_interface
    if config.nnodes > 1:
        # Node 0's frontend hosts the store at --dist-init-addr (frontend/cluster/node_rendezvous.py), behind the
        # cluster key: every rank joins as a client, under a prefix of its own beside the nodes' keys.
        host, port = dist_init_addr.rsplit(":", 1)
        client = CurveStoreClient(host.strip("[]"), int(port), ClusterKey.load(config.cluster_key_file),
                                  timeout=DIST_INIT_TIMEOUT)
        store = dist.PrefixStore("tp/", torch_store(client))
        dist.init_process_group(backend=backend, store=store, world_size=config.tp, rank=rank,
                                timeout=DIST_INIT_TIMEOUT, device_id=device if device.type == "cuda" else None)
        return
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{dist_init_addr}",
        world_size=config.tp,
        rank=rank,
        timeout=DIST_INIT_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )


def set_serving_timeout(config: ServerConfig) -> None:
    """Collectives time out after --dist-timeout from now on (start-up ran under DIST_INIT_TIMEOUT: loading a large
    checkpoint may take minutes). A timed-out collective raises, and the rank exits (worker/process.py)."""
    if dist.is_initialized():
        # The public API sets a timeout only at init; this is what it does per backend (gloo and nccl alike).
        _set_pg_timeout(timedelta(seconds=config.dist_timeout))


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
