"""The worker process: start up (model shard, KV cache, sockets), report ready, then serve the scheduler's messages."""

from __future__ import annotations

import logging

import msgspec

from protocol.proc import die_with_parent, read_process_args, setup_logging
from protocol.sockets import PULL, PUSH, TypedSocket
from protocol.structs import (
    BatchResult,
    DropAdapters,
    ForwardBatch,
    LoadLoRAAdapterReqInput,
    LoRAAdapterResult,
    ProcessArgs,
    ProcessFailed,
    SchedulerToWorker,
    Shutdown,
    WorkerAdapterReport,
    WorkerReady,
)
from worker.batch_inputs import BatchError
from worker.dist import destroy_distributed, global_rank, init_distributed, pick_device, ranks_per_node
from worker.model_runner import ModelRunner

logger = logging.getLogger("worker")

# How long a failing worker waits for its ProcessFailed to leave (the sockets otherwise drop unsent messages).
FAILURE_FLUSH_MS = 2000


class Worker:
    def __init__(self, args: ProcessArgs, rank: int, to_scheduler: TypedSocket):
        config, endpoints = args.config, args.endpoints
        if not 0 <= args.rank < min(ranks_per_node(config), len(endpoints.scheduler_to_workers)):
            raise ValueError(f"local rank {args.rank} does not fit tp {config.tp} over {config.nnodes} node(s)")
        self.rank = rank
        self.to_scheduler = to_scheduler
        self.from_scheduler = TypedSocket(
            PULL, endpoints.scheduler_to_workers[args.rank], bind=True, recv_type=SchedulerToWorker
        )
        device = pick_device(config, args.rank)
        init_distributed(config, endpoints.dist_init_addr, rank, device)
        logger.info("loading model from %s on %s", args.model_dir, device)
        self.runner = ModelRunner(config, args.model_dir, rank, config.tp, device)
        logger.info(
            "ready: KV cache %d tokens, context length %d, vocab %d",
            self.runner.max_total_tokens,
            self.runner.context_length,
            self.runner.vocab_size,
        )

    def serve(self) -> None:
        self.to_scheduler.send(
            WorkerReady(
                rank=self.rank,
                max_total_tokens=self.runner.max_total_tokens,
                context_length=self.runner.context_length,
                vocab_size=self.runner.vocab_size,
            )
        )
        while True:
            msg = self.from_scheduler.recv()
            if isinstance(msg, Shutdown):
                return
            reply = self.handle(msg)
            if reply is not None:
                self.to_scheduler.send(reply)

    def handle(self, msg: SchedulerToWorker) -> msgspec.Struct | None:
        if isinstance(msg, ForwardBatch):
            return self.run_batch(msg)
        if isinstance(msg, LoadLoRAAdapterReqInput):
            return self.refuse_adapters(msg)
        if isinstance(msg, DropAdapters):
            return None  # nothing is ever loaded while LoRA is off
        raise TypeError(f"unexpected message {type(msg).__name__}")

    def run_batch(self, batch: ForwardBatch) -> BatchResult | None:
        # Every rank runs the batch (the collectives need them all); rank 0's tokens are the ones sent. A bad batch
        # fails on every rank alike, before any collective, since all ranks see the same batch.
        try:
            next_token_ids, error_message = self.runner.forward(batch), ""
        except BatchError as e:  # the batch itself is wrong: the message says it all
            logger.error("batch %d rejected: %s", batch.batch_id, e)
            next_token_ids, error_message = [], f"{type(e).__name__}: {e}"
        except Exception as e:
            logger.exception("batch %d failed", batch.batch_id)
            next_token_ids, error_message = [], f"{type(e).__name__}: {e}"
        if self.rank != 0:
            return None
        return BatchResult(batch_id=batch.batch_id, next_token_ids=next_token_ids, error_message=error_message)

    def refuse_adapters(self, msg: LoadLoRAAdapterReqInput) -> WorkerAdapterReport:
        results = [
            LoRAAdapterResult(
                lora_name=spec.lora_name, success=False, error_message="LoRA not enabled", lora_id=spec.lora_id
            )
            for spec in msg.adapters
        ]
        return WorkerAdapterReport(rank=self.rank, results=results)

    def close(self) -> None:
        self.from_scheduler.close()
        self.to_scheduler.close()
        destroy_distributed()


def main() -> int:
    args = read_process_args()
    die_with_parent()
    config = args.config
    rank = global_rank(config, args.rank)
    setup_logging(config.log_level, f"worker{rank}")
    to_scheduler = TypedSocket(PUSH, args.endpoints.workers_to_scheduler, bind=False)
    try:
        worker = Worker(args, rank, to_scheduler)
    except Exception as e:
        logger.exception("start-up failed")
        to_scheduler.send(ProcessFailed(who=f"worker{rank}", error_message=f"{type(e).__name__}: {e}"))
        to_scheduler.sock.close(linger=FAILURE_FLUSH_MS)
        return 1
    worker.serve()
    logger.info("shutting down")
    worker.close()
    return 0
