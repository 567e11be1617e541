"""AdapterLoader: a thread that reads, validates and installs adapters while the main loop runs forward passes.

It has its own sockets: the scheduler sends loads straight to it (`Endpoints.scheduler_to_loaders`), so a load that
arrives in the middle of a forward pass starts reading at once instead of after the pass, and its report leaves as
soon as the host copy is in place. Installing is a dict insert of a new lora_id, which no running pass refers to; the
scheduler names an adapter in a slot load only after every rank has reported it loaded.
"""

from __future__ import annotations

import logging
import threading
import time

from protocol.sockets import PULL, PUSH, TypedSocket
from protocol.structs import LoadLoRAAdapterReqInput, ProcessArgs, WorkerAdapterReport
from worker.lora.adapter import AdapterLoadError
from worker.lora.manager import LoRAManager

logger = logging.getLogger("worker.loader")

INBOX = "inproc://adapter-loads"  # the main loop forwards loads that reached it on the batch socket
STOP_POLL_MS = 200

# Test-only fault injection (ProcessArgs.fault_hooks, all values strings); inert unless set:
#   fail_load_on_rank=N  global rank N fails every adapter load with "injected fault on rank N"
#   fail_load_name=NAME  ... only the loads of adapters named NAME (with fail_load_on_rank)
#   load_delay_s=S       every adapter load sleeps S seconds first (tests of loads off the decode loop)


class AdapterLoader(threading.Thread):
    def __init__(self, args: ProcessArgs, rank: int, manager: LoRAManager):
        super().__init__(name="adapter-loader", daemon=True)
        self.rank = rank
        self.manager = manager
        self.inbox = TypedSocket(PULL, INBOX, bind=True, recv_type=LoadLoRAAdapterReqInput)
        loader_addrs = args.endpoints.scheduler_to_loaders
        if loader_addrs:
            self.inbox.sock.bind(loader_addrs[args.rank])
        self.to_scheduler = TypedSocket(PUSH, args.endpoints.workers_to_scheduler, bind=False)
        hooks = args.fault_hooks
        self.fail_loads = hooks.get("fail_load_on_rank") == str(rank)
        self.fail_load_name = hooks.get("fail_load_name")
        self.load_delay_s = float(hooks.get("load_delay_s", 0))
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            msg = self.inbox.recv(timeout_ms=STOP_POLL_MS)
            if msg is not None:
                self.to_scheduler.send(self.load(msg))

    def load(self, msg: LoadLoRAAdapterReqInput) -> WorkerAdapterReport:
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        outcomes = self.manager.read(msg.adapters)
        if self.fail_loads:
            fault = AdapterLoadError(f"injected fault on rank {self.rank}", "internal")
            outcomes = [
                fault if self.fail_load_name in (None, spec.lora_name) else outcome
                for spec, outcome in zip(msg.adapters, outcomes, strict=True)
            ]
        return WorkerAdapterReport(rank=self.rank, results=self.manager.install(msg.adapters, outcomes))

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=2 * STOP_POLL_MS / 1000)
        self.inbox.close()
        self.to_scheduler.close()
