"""AdapterLoader: reads, validates and installs adapters while the main loop runs forward passes.

The scheduler sends every LoadAdapters straight to this rank's loader socket (`Endpoints.scheduler_to_loaders`), the
one route adapter data takes, so a load that arrives mid forward pass starts reading at once. Each operation reads on
a thread of its own: a read that hangs (a stuck network file system) delays only its own operation, which the
scheduler fails at its deadline and drops everywhere, and later loads go on. The report names the operation
(`op_id`); installing is a dict insert of a new lora_id, which no running pass refers to, and the scheduler names an
adapter in a slot load only after every rank has reported it loaded.
"""

from __future__ import annotations

import logging
import threading
import time

from loraplex.protocol.curve import ClusterKey
from loraplex.protocol.faults import FaultPlan
from loraplex.protocol.sockets import PULL, PUSH, TypedSocket
from loraplex.protocol.structs import AdapterOutcome, AdapterReport, AdapterToLoad, LoadAdapters, ProcessArgs
from loraplex.worker.lora.adapter import AdapterLoadError
from loraplex.worker.lora.draft_adapters import DraftAdapters
from loraplex.worker.lora.manager import LoRAManager

logger = logging.getLogger("loraplex.worker.loader")

STOP_POLL_MS = 200


class AdapterLoader(threading.Thread):
    def __init__(self, args: ProcessArgs, rank: int, manager: LoRAManager | None, faults: FaultPlan,
                 key: ClusterKey | None = None, draft: DraftAdapters | None = None):
        super().__init__(name="adapter-loader", daemon=True)
        self.rank = rank
        self.manager = manager
        self.draft = draft  # the draft model's adapters (speculative decoding): loaded with their targets
        inbox_addr = args.endpoints.scheduler_to_loaders[args.local_rank]
        self.inbox = TypedSocket(PULL, inbox_addr, bind=True, recv_type=LoadAdapters, key=key)
        self.to_scheduler = TypedSocket(PUSH, args.endpoints.workers_to_scheduler, bind=False, key=key)
        self.send_lock = threading.Lock()  # zmq sockets are not thread-safe; reports leave from the op threads
        # Test-only fault injection (protocol/faults.py); inert unless a test set it.
        on_replica = faults.fail_load_on_replica in (None, args.dp_rank)
        self.fail_loads = on_replica and faults.fail_load_on_rank == rank
        self.hang_loads = on_replica and faults.hang_load_on_rank == rank
        self.fault_name = faults.fail_load_name
        self.load_delay_s = faults.load_delay_s
        self.refuse_paths = faults.refuse_path_loads
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            got = self.inbox.recv_with_frames(timeout_ms=STOP_POLL_MS)
            if got is not None:
                op, frames = got
                threading.Thread(target=self.serve, args=(op, frames), name=f"adapter-load-{op.op_id}",
                                 daemon=True).start()

    def serve(self, op: LoadAdapters, frames: list) -> None:
        """`frames`: the inline adapters' tensor bytes, which follow the message."""
        report = AdapterReport(op_id=op.op_id, tp_rank=self.rank, outcomes=self.load(op, frames))
        if self.stopping.is_set():
            return
        with self.send_lock:
            self.to_scheduler.send(report)

    def load(self, op: LoadAdapters, frames: list) -> list[AdapterOutcome]:
        if self.manager is None:
            return [AdapterOutcome(lora_id=a.lora_id, success=False, error_message="LoRA is not enabled",
                                   error_kind="invalid") for a in op.adapters]
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        is_target = any(self.fault_name in (None, a.lora_name) for a in op.adapters)
        if self.hang_loads and is_target:
            logger.warning("op %d: injected hang on rank %d", op.op_id, self.rank)
            self.stopping.wait()
            return []
        if self.refuse_paths and any(a.lora_path is not None for a in op.adapters):  # refused before any read
            return [AdapterOutcome(lora_id=a.lora_id, success=False, error_kind="internal",
                                   error_message=f"injected: rank {self.rank} reads no adapter path")
                    for a in op.adapters]
        if frames:  # what came over the wire for this rank: with frames_per_rank, its part of each tensor only
            num_bytes = sum(memoryview(f).nbytes for f in frames)
            part = ", this rank's part" if op.frames_per_rank else ""
            logger.info("op %d: %d tensor frames, %d bytes%s", op.op_id, len(frames), num_bytes, part)
        outcomes = self.manager.read(op.adapters, frames, op.frames_per_rank)
        if self.fail_loads:
            fault = AdapterLoadError(f"injected fault on rank {self.rank}", "internal")
            outcomes = [
                fault if self.fault_name in (None, spec.lora_name) else outcome
                for spec, outcome in zip(op.adapters, outcomes, strict=True)
            ]
        if self.draft is None:
            return self.manager.install(op.adapters, self._refuse_drafts(op.adapters, outcomes))
        # a target and its draft adapter load together or not at all
        outcomes, pending = self.draft.read(op.adapters, outcomes)
        outcomes = self.draft.install(op.adapters, outcomes, pending)
        results = self.manager.install(op.adapters, outcomes)
        self.draft.forget_failed(results)
        return results

    def _refuse_drafts(self, adapters: list[AdapterToLoad], outcomes: list) -> list:
        """No draft model's adapters here: an adapter that brings one is refused (the frontend refuses it first)."""
        return [AdapterLoadError(f"adapter {a.lora_name!r}: draft_lora_path needs a draft model", "invalid")
                if a.draft_lora_path is not None else o for a, o in zip(adapters, outcomes, strict=True)]  # fmt: skip

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=2 * STOP_POLL_MS / 1000)
        with self.send_lock:
            self.inbox.close()
            self.to_scheduler.close()
