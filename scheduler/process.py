"""SchedulerProcess: the scheduler's sockets, its start-up handshake with the workers, and the main loop."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
from loraplex.protocol.curve import ClusterKey
from loraplex.protocol.proc import die_with_parent, read_process_args, setup_logging
from loraplex.protocol.sockets import PULL, PUSH, TypedSocket, wait_readable
from loraplex.protocol.structs import (
    AbortReq,
    AdapterReport,
    BatchResult,
    DropAdapters,
    FrontendToScheduler,
    LoadAdapters,
    ProcessArgs,
    ProcessFailed,
    SchedulerReady,
    SchedulerStatsReq,
    Shutdown,
    SlotsChanged,
    TokenDelta,
    TokenDeltas,
    TokenizedGenerateReq,
    WorkerReady,
    WorkerToScheduler,
    frames_of_rank,
)
from loraplex.scheduler.adapter_table import LoadFinished
from loraplex.scheduler.scheduler import Scheduler

log = logging.getLogger("scheduler")

IDLE_POLL_MS = 100  # an idle scheduler sleeps in a poll of both sockets; it wakes at once for any message
RESULT_POLL_MS = 5  # while a forward pass runs, the frontend socket is checked this often (aborts, new requests)
READY_POLL_MS = 100
STALL_WARNING_S = 30.0
SEND_LINGER_MS = 1000  # closing waits this long for queued messages (Shutdown, ProcessFailed) to leave


class ProcessExit(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class SchedulerProcess:
    def __init__(self, args: ProcessArgs):
        endpoints = args.endpoints
        self.config = args.config
        self.from_frontend = TypedSocket(
            PULL, endpoints.frontend_to_scheduler, bind=True, recv_type=FrontendToScheduler
        )
        key = ClusterKey.of(self.config.cluster_key_file)  # CURVE on the TCP sockets to other nodes' ranks
        self.from_workers = TypedSocket(PULL, endpoints.workers_to_scheduler, bind=True, recv_type=WorkerToScheduler,
                                        key=key)
        self.to_workers = [TypedSocket(PUSH, addr, bind=False, key=key) for addr in endpoints.scheduler_to_workers]
        # Loads go to the ranks' loader threads at once, even mid pass: the one route adapter data takes.
        self.to_loaders = [TypedSocket(PUSH, addr, bind=False, key=key) for addr in endpoints.scheduler_to_loaders]
        self.to_frontend = TypedSocket(PUSH, endpoints.scheduler_to_frontend, bind=False)
        self.scheduler: Scheduler | None = None
        self.deltas: list[TokenDelta] = []  # sent together, once per step
        self.sent_slot_table: list[int] = []  # the slot table the frontend last heard of
        self.deferred_drops: list[DropAdapters] = []  # drops that arrived during a forward pass
        self.early_results: dict[int, BatchResult] = {}  # results read before their turn (two passes in flight)
        # frontend messages (and their extra frames) that arrived before the workers were ready
        self.early_msgs: list[tuple[Any, list]] = []

    def run(self) -> None:
        """Serve until Shutdown (raises ProcessExit). Two passes in flight: the workers start the next one as soon as
        they finish one, while this loop processes the finished one's result."""
        self.scheduler = self.start()
        while True:
            self.recv_requests()
            while not self.deferred_drops and self.scheduler.can_schedule:
                batch = self.scheduler.schedule()
                if batch is None:
                    break
                self.broadcast(batch)
            if self.scheduler.has_batch_in_flight:
                result = self.wait_for_result(self.scheduler.oldest_batch_id)
                self.deltas += self.scheduler.process_result(result)
            if not self.scheduler.has_batch_in_flight:
                self.run_deferred_drops()
            self.send_deltas()

    # ---- start-up --------------------------------------------------------------------------------------

    def start(self) -> Scheduler:
        ready: dict[int, WorkerReady] = {}
        while len(ready) < len(self.to_workers):
            msg = _recv(self.from_workers, READY_POLL_MS)
            if isinstance(msg, WorkerReady):
                ready[msg.tp_rank] = msg
            elif isinstance(msg, ProcessFailed):
                self.to_frontend.send(msg)
                raise ProcessExit(1)
            elif msg is not None:
                log.warning("ignoring %s from a worker before start-up finished", type(msg).__name__)
            while (got := _recv_with_frames(self.from_frontend)) is not None:
                if isinstance(got[0], Shutdown):
                    self.broadcast(got[0])
                    raise ProcessExit(0)
                self.early_msgs.append(got)
        page_size = self.config.page_size
        num_pages = min(r.max_total_tokens for r in ready.values()) // page_size
        if num_pages < 1:
            self.report_failure(f"the KV cache holds less than one page of {page_size} tokens")
            raise ProcessExit(1)
        first = ready[min(ready)]
        context_length = min(r.context_length for r in ready.values())
        scheduler = Scheduler(
            self.config,
            num_pages=num_pages,
            context_length=context_length,
            num_ranks=len(ready),
            chunked_prefill_size=self.config.chunked_prefill_tokens(first.device_type, first.is_pooling),
            attention_window=first.attention_window,  # one model on every rank
            long_rope_len=first.long_rope_len,
            num_state_slots=first.num_state_slots,
            num_state_snapshots=first.num_state_snapshots,
            pools_whole_prompt=first.pools_whole_prompt,
            images_whole=first.images_whole,
        )
        self.to_frontend.send(
            SchedulerReady(
                max_total_tokens=scheduler.max_total_tokens,
                context_length=context_length,
                vocab_size=first.vocab_size,
                max_lora_rank=first.max_lora_rank,
                lora_target_modules=first.lora_target_modules,
                model_type=first.model_type,
                num_hidden_layers=first.num_hidden_layers,
                grammar_error=next((r.grammar_error for r in ready.values() if r.grammar_error), ""),
                kv_bytes_per_token=first.kv_bytes_per_token,
            )
        )
        log.info("ready: %d ranks, %d KV pages of %d tokens", len(ready), num_pages, page_size)
        self.scheduler = scheduler
        self.sent_slot_table = scheduler.slots.slot_table()  # all empty, as the frontend assumes
        for msg, frames in self.early_msgs:
            self.on_frontend(msg, frames)
        self.early_msgs = []
        return scheduler

    # ---- the loop's steps ---------------------------------------------------------------------------------

    def recv_requests(self) -> None:
        # Sleep in poll only when there is nothing to run, so an idle scheduler uses no CPU.
        if self.scheduler.is_idle and not self.deltas:
            wait_readable([self.from_frontend, self.from_workers], IDLE_POLL_MS)
        self.drain_frontend()
        while (msg := _recv(self.from_workers)) is not None:
            self.on_worker(msg)
        self.expire_adapter_loads()

    def drain_frontend(self) -> None:
        while (got := _recv_with_frames(self.from_frontend)) is not None:
            self.on_frontend(*got)

    def wait_for_result(self, batch_id: int) -> BatchResult:
        """Rank 0's result for the batch; the frontend is still served meanwhile (aborts, stats, Shutdown)."""
        if batch_id in self.early_results:  # it came in while recv_requests drained the workers' socket
            return self.early_results.pop(batch_id)
        started = last_warning = time.monotonic()
        while True:
            msg = _recv(self.from_workers, RESULT_POLL_MS)
            if isinstance(msg, BatchResult) and msg.batch_id == batch_id:
                return msg
            if msg is not None:
                self.on_worker(msg)
            self.drain_frontend()
            self.expire_adapter_loads()
            if time.monotonic() - last_warning > STALL_WARNING_S:
                last_warning = time.monotonic()
                log.warning("batch %d: no result from rank 0 after %.0f s", batch_id, last_warning - started)

    def send_deltas(self) -> None:
        if self.deltas:
            self.to_frontend.send(TokenDeltas(deltas=self.deltas))
            self.deltas = []
        slot_table = self.scheduler.slots.slot_table()
        if slot_table != self.sent_slot_table:  # rare: only when an adapter enters or leaves a slot
            self.sent_slot_table = slot_table
            self.to_frontend.send(SlotsChanged(slot_lora_ids=slot_table))

    def broadcast(self, msg: msgspec.Struct) -> None:
        for sock in self.to_workers:
            sock.send(msg)

    # ---- messages -------------------------------------------------------------------------------------------

    def on_frontend(self, msg: Any, frames: list) -> None:
        """`frames`: a LoadAdapters' inline tensor bytes, passed on to the loaders untouched (each rank its own when
        node 0 cut them per rank)."""
        if isinstance(msg, TokenizedGenerateReq):
            self.deltas += self.scheduler.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.deltas += self.scheduler.abort(msg.rid)
        elif isinstance(msg, SchedulerStatsReq):
            self.to_frontend.send(self.scheduler.stats(msg.op_id))
        elif isinstance(msg, LoadAdapters):
            self.start_load(msg, frames)  # reading needs no pause between passes; only slot changes do
        elif isinstance(msg, DropAdapters):
            self.deferred_drops.append(msg)
            if not self.scheduler.has_batch_in_flight:
                self.run_deferred_drops()
        elif isinstance(msg, Shutdown):
            self.broadcast(msg)
            raise ProcessExit(0)
        else:
            log.warning("ignoring unexpected %s from the frontend", type(msg).__name__)

    def on_worker(self, msg: Any) -> None:
        if isinstance(msg, AdapterReport):
            done = self.scheduler.add_adapter_report(msg)
            if done is not None:
                self.finish_load(done)
        elif isinstance(msg, ProcessFailed):
            self.send_deltas()
            self.to_frontend.send(msg)
            raise ProcessExit(1)
        elif isinstance(msg, BatchResult) and self.scheduler.is_in_flight(msg.batch_id):
            self.early_results[msg.batch_id] = msg
        elif isinstance(msg, BatchResult):
            log.warning("ignoring a result for batch %d, which is not in flight", msg.batch_id)
        else:
            log.warning("ignoring unexpected %s from a worker", type(msg).__name__)

    def start_load(self, op: LoadAdapters, frames: list) -> None:
        out = self.scheduler.load_adapters(op, time.monotonic())
        if isinstance(out, LoadFinished):
            self.finish_load(out)
        else:  # the reply follows the ranks' reports, or the deadline
            for tp_rank, sock in enumerate(self.to_loaders):
                sock.send(out, frames_of_rank(out, frames, tp_rank, len(self.to_loaders)))

    def expire_adapter_loads(self) -> None:
        for done in self.scheduler.expire_adapter_loads(time.monotonic()):
            log.error("adapter load op %d: %s", done.reply.op_id,
                      "; ".join(o.error_message for o in done.reply.outcomes if not o.success))
            self.finish_load(done)

    def finish_load(self, done: LoadFinished) -> None:
        if done.rollback is not None:  # the workers' socket: they apply it before any later batch
            self.broadcast(done.rollback)
        self.to_frontend.send(done.reply)

    def run_deferred_drops(self) -> None:
        """Drops run between forward passes (they change slots), in the order they arrived."""
        drops, self.deferred_drops = self.deferred_drops, []
        for drop in drops:
            reply, deltas = self.scheduler.drop_adapters(drop)
            self.deltas += deltas
            self.send_deltas()
            self.broadcast(drop)
            self.to_frontend.send(reply)

    # ---- exit -------------------------------------------------------------------------------------------------

    def report_failure(self, error_message: str) -> None:
        self.to_frontend.send(ProcessFailed(who="scheduler", error_message=error_message))

    def close(self) -> None:
        self.from_frontend.close()
        self.from_workers.close()
        for typed in [*self.to_workers, *self.to_loaders, self.to_frontend]:
            typed.sock.close(linger=SEND_LINGER_MS)
        self.to_frontend.sock.context.term()  # returns once the queued messages left, or the linger ran out


def _recv_with_frames(sock: TypedSocket, timeout_ms: int = 0) -> tuple[Any, list] | None:
    """As _recv, with the message's extra frames."""
    while True:
        try:
            return sock.recv_with_frames(timeout_ms)
        except msgspec.DecodeError as e:
            log.error("dropped a message that does not decode: %s", e)
            timeout_ms = 0


def _recv(sock: TypedSocket, timeout_ms: int = 0) -> Any:
    """The next message within timeout_ms (0: only one already queued), or None. Undecodable ones are logged."""
    while True:
        try:
            return sock.recv(timeout_ms)
        except msgspec.DecodeError as e:
            log.error("dropped a message that does not decode: %s", e)
            timeout_ms = 0


def main() -> int:
    args = read_process_args()
    die_with_parent()
    setup_logging(args.config.log_level, "scheduler")
    proc = SchedulerProcess(args)
    try:
        proc.run()
    except ProcessExit as e:
        return e.code
    except Exception as e:
        log.exception("scheduler failed")
        proc.report_failure(f"scheduler failed: {type(e).__name__}: {e}")
        return 1
    finally:
        proc.close()
    return 0
