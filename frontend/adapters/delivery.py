"""AdapterDelivery: one adapter operation on every rank of every data-parallel replica — load (integrity checks first,
node 0 reading the files for the other nodes, rollback where not every replica loaded it) and drop.

An adapter to load travels with its own tensor frames (a Shipment) until the socket, where the frames of all the
operation's adapters are laid out as LoadAdapters says.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec
from loraplex.frontend.adapters.files import cut_per_rank, read_adapter_dir
from loraplex.frontend.adapters.integrity import AdapterIntegrity
from loraplex.frontend.cluster.replica_set import ReplicaSet, merge_replica_answers
from loraplex.frontend.metrics import Metrics
from loraplex.protocol.adapters.adapter_config import AdapterLoadError
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.errors import ServerError
from loraplex.protocol.structs import AdapterOutcome, AdapterToLoad, DropAdapters, InlineAdapter, LoadAdapters

logger = logging.getLogger("loraplex.adapters")

# The scheduler fails a load at --lora-load-timeout itself; the frontend waits this much longer before it gives up
# on the scheduler (a stuck forward pass) and rolls back on its own.
SCHEDULER_MARGIN_S = 5.0


@dataclass(frozen=True)
class Shipment:
    """One adapter to load and its tensor frames (the bytes of adapter.inline.tensors, in order; none for a directory
    load)."""

    adapter: AdapterToLoad
    frames: list = field(default_factory=list)


class AdapterDelivery:
    def __init__(self, config: ServerConfig, replicas: ReplicaSet, metrics: Metrics):
        self.config = config
        self.replicas = replicas
        self.metrics = metrics
        self.integrity = AdapterIntegrity(config)

    async def load(self, shipments: list[Shipment], op_name: str) -> list[AdapterOutcome]:
        """Load on every rank: one outcome per adapter. A missed deadline is an outcome, rolled back everywhere."""
        if not shipments:
            return []
        t0 = time.monotonic()
        adapters = [s.adapter for s in shipments]
        refused = await asyncio.get_running_loop().run_in_executor(None, self._integrity_failures, adapters)
        # refused ones never reach a rank; their frames stay here too
        to_send = [s for s in shipments if s.adapter.lora_id not in refused]
        frames_per_rank = self.config.nnodes > 1
        if frames_per_rank and to_send:  # node 0 reads the files; every rank gets its part as raw tensor frames
            to_send, rank_frames, unread = await self._read_for_nodes(to_send)
            refused.update(unread)
            frames = [frame for run in rank_frames for frame in run]
        else:
            frames = [frame for s in to_send for frame in s.frames]
        sent_adapters = [s.adapter for s in to_send]
        outcomes = await self._load_everywhere(sent_adapters, frames, frames_per_rank) if to_send else []
        sent = dict(zip([a.lora_id for a in sent_adapters], outcomes, strict=True))
        outcomes = [refused.get(a.lora_id) or sent[a.lora_id] for a in adapters]
        elapsed_s = time.monotonic() - t0
        for adapter, outcome in zip(adapters, outcomes, strict=True):
            self.metrics.on_adapter_op(op_name, outcome.success, elapsed_s)
            logger.info("%s adapter %s path=%s rank=%s %s in %.1f ms%s", op_name, adapter.lora_name,
                        adapter.lora_path or "(tensors)",
                        outcome.lora_rank or "?", "ok" if outcome.success else "FAILED", elapsed_s * 1e3,
                        "" if outcome.success else f": {outcome.error_message}")
        return outcomes

    async def drop(self, lora_ids: list[int]) -> None:
        """Drop on every replica; the first replica's ServerError is raised."""
        if not lora_ids:
            return
        op = DropAdapters(op_id=self.replicas.next_op_id(), lora_ids=lora_ids)
        replies = await self.replicas.call_all(op, self.config.lora_load_timeout + SCHEDULER_MARGIN_S)
        failed = next((reply for reply in replies if isinstance(reply, ServerError)), None)
        if failed is not None:
            raise failed

    def _integrity_failures(self, adapters: list[AdapterToLoad]) -> dict[int, AdapterOutcome]:
        """The adapters AdapterIntegrity refuses (base model, manifest), by id, worded as a rank's refusal."""
        failures = {}
        for adapter in adapters:
            try:
                if adapter.inline is not None:
                    self.integrity.check_config(adapter.lora_name, adapter.inline.config)
                else:
                    self.integrity.check_dir(adapter.lora_name, adapter.lora_path, adapter.root)
            except AdapterLoadError as e:
                failures[adapter.lora_id] = AdapterOutcome(lora_id=adapter.lora_id, success=False,
                                                           error_message=str(e), error_kind=e.kind)
        return failures

    async def _read_for_nodes(self, shipments: list[Shipment]
                              ) -> tuple[list[Shipment], list[list], dict[int, AdapterOutcome]]:
        """Directory loads turned into inline ones (config and tensor frames read here), so ranks on other nodes
        never open a path, and every tensor cut per TP rank: (what to send, each TP rank's run of frames as
        LoadAdapters.frames_per_rank lays them out, the adapters that could not be read)."""
        loop = asyncio.get_running_loop()
        to_send, failures = [], {}
        rank_frames: list[list] = [[] for _ in range(self.config.tp)]
        for shipment in shipments:
            adapter, own_frames = shipment.adapter, shipment.frames
            if adapter.inline is None:
                try:
                    config, specs, own_frames = await loop.run_in_executor(
                        None, read_adapter_dir, adapter.lora_path, adapter.root, adapter.lora_name)
                except AdapterLoadError as e:  # worded and kinded as a worker's refusal of the same files
                    failures[adapter.lora_id] = AdapterOutcome(lora_id=adapter.lora_id, success=False,
                                                               error_message=str(e), error_kind=e.kind)
                    continue
                adapter = msgspec.structs.replace(adapter, lora_path=None,
                                                  inline=InlineAdapter(config=config, tensors=specs))
            to_send.append(Shipment(adapter, own_frames))
            cut = await loop.run_in_executor(None, cut_per_rank, adapter.inline.tensors, own_frames, self.config.tp)
            for frames, part in zip(rank_frames, cut, strict=True):
                frames += part
        return to_send, rank_frames, failures

    async def _load_everywhere(self, adapters: list[AdapterToLoad], frames: list,
                               frames_per_rank: bool = False) -> list[AdapterOutcome]:
        """One LoadAdapters to every replica; the merged outcomes, and what must go again rolled back."""
        op = LoadAdapters(op_id=self.replicas.next_op_id(), adapters=adapters, frames_per_rank=frames_per_rank)
        timeout_s = self.config.lora_load_timeout + SCHEDULER_MARGIN_S
        answers = [reply if isinstance(reply, ServerError) else reply.outcomes
                   for reply in await self.replicas.call_all(op, timeout_s, frames)]
        outcomes, rollback = merge_replica_answers([a.lora_id for a in adapters], answers, self.replicas.who)
        # A replica's scheduler rolls back its own ranks; what loaded on one replica but failed on another, or was sent
        # to a scheduler that did not answer (it may load it once it listens again), is dropped here.
        for dp_rank, lora_ids in rollback.items():
            try:
                await self.replicas.call(dp_rank, DropAdapters(op_id=self.replicas.next_op_id(), lora_ids=lora_ids),
                                         timeout_s)
            except ServerError as rollback_error:
                logger.error("rollback of op %d failed: %s", op.op_id, rollback_error)
        return outcomes
