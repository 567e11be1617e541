"""The worker process: start up (model shard, KV cache, sockets), report ready, then serve the scheduler's messages."""

from __future__ import annotations

import logging
import os
import time

import msgspec
import torch
from loraplex.kernels import BackendError
from loraplex.protocol import cpu_cores
from loraplex.protocol.curve import ClusterKey
from loraplex.protocol.faults import FaultPlan, read_fault_plan
from loraplex.protocol.proc import die_with_parent, read_process_args, setup_logging
from loraplex.protocol.sockets import PULL, PUSH, TypedSocket, send_last
from loraplex.protocol.structs import (
    BatchResult,
    DropAdapters,
    ForwardBatch,
    ProcessArgs,
    ProcessFailed,
    SchedulerToWorker,
    Shutdown,
    WorkerReady,
)
from loraplex.worker.adapter_loader import AdapterLoader
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.dist import (
    destroy_distributed,
    global_rank,
    init_distributed,
    pick_device,
    ranks_per_node,
    set_serving_timeout,
)
from loraplex.worker.loader import CheckpointError
from loraplex.worker.model_runner import ModelRunner
from loraplex.worker.quant import QuantFormatError

logger = logging.getLogger("worker")

# How long a failing worker waits for its ProcessFailed to leave (the sockets otherwise drop unsent messages).
FAILURE_FLUSH_MS = 2000


class Worker:
    def __init__(self, args: ProcessArgs, tp_rank: int, to_scheduler: TypedSocket, faults: FaultPlan,
                 key: ClusterKey | None = None):
        config, endpoints = args.config, args.endpoints
        if not 0 <= args.local_rank < min(ranks_per_node(config), len(endpoints.scheduler_to_workers)):
            raise ValueError(f"local rank {args.local_rank} does not fit tp {config.tp} over {config.nnodes} node(s)")
        self.tp_rank = tp_rank
        self.to_scheduler = to_scheduler
        self.from_scheduler = TypedSocket(
            PULL, endpoints.scheduler_to_workers[args.local_rank], bind=True, recv_type=SchedulerToWorker, key=key
        )
        # Replica r's ranks use devices r * ranks_per_node ... (r + 1) * ranks_per_node - 1 on this node.
        device = pick_device(config, args.dp_rank * ranks_per_node(config) + args.local_rank)
        self.service_cores: tuple[int, ...] = ()  # where the frontend and scheduler keep to (WorkerReady)
        if device.type == "cpu" and ("OMP_NUM_THREADS" not in os.environ or cpu_cores.BIND_ENV in os.environ):
            # The ranks share the host's cores with the frontend, the scheduler and often the clients. A thread pool
            # wider than what is free makes every small op wait at a barrier for a descheduled thread (measured on
            # 2 cores under load: 6x slower decode steps, 90x with many LoRA segments), so leave one core free, and
            # where the host has cores to spare pin each rank's threads to cores of their own (protocol/cpu_cores.py).
            local_workers = ranks_per_node(config) * config.dp_size
            local_index = args.dp_rank * ranks_per_node(config) + args.local_rank
            plan = cpu_cores.plan_cores(sorted(os.sched_getaffinity(0)), local_workers,
                                        os.environ.get(cpu_cores.BIND_ENV))
            if plan.worker_cores:
                cpu_cores.pin_to(plan.worker_cores[local_index])  # before torch's pool starts: its threads inherit it
                self.service_cores = plan.service_cores
            torch.set_num_threads(plan.num_threads)
            logger.info("%s", plan.describe(local_index))
        init_distributed(config, endpoints.dist_init_addr, tp_rank, device)
        logger.info("loading model from %s on %s", args.model_dir, device)
        self.runner = ModelRunner(config, args.model_dir, tp_rank, config.tp, device)
        logger.info(
            "ready: KV cache %d tokens, context length %d, vocab %d",
            self.runner.max_total_tokens,
            self.runner.context_length,
            self.runner.vocab_size,
        )
        # Adapter reads (disk, validation, slicing) run on their own threads, off the decode loop.
        self.loader = AdapterLoader(args, tp_rank, self.runner.lora, faults, key, self.runner.draft_adapters)
        self.last_token_ids: list[int] = []  # what the previous batch sampled, row by row
        self.loader.start()
        # Test-only fault injection (protocol/faults.py); inert unless a test set it.
        self.crash_forward = faults.crash_forward_on_rank == tp_rank
        self.stall_forward_s = faults.stall_forward_s if faults.stall_forward_on_rank == tp_rank else 0.0
        # Start-up is over: from here a collective that outlasts --dist-timeout raises, and the rank exits.
        set_serving_timeout(config)

    def serve(self) -> None:
        lora = self.runner.lora
        self.to_scheduler.send(
            WorkerReady(
                tp_rank=self.tp_rank,
                device_type=self.runner.device.type,
                max_total_tokens=self.runner.max_total_tokens,
                context_length=self.runner.context_length,
                vocab_size=self.runner.vocab_size,
                max_lora_rank=lora.spec.max_lora_rank if lora else 0,
                lora_target_modules=list(lora.spec.target_modules) if lora else [],
                model_type=self.runner.model_config.model_type,
                num_hidden_layers=self.runner.model_config.num_layers,
                attention_window=self.runner.model_config.attention_window,
                long_rope_len=self.runner.long_rope_len,
                grammar_error=self.runner.grammar.import_error,
                kv_bytes_per_token=self.runner.kv_bytes_per_token,
                num_state_slots=self.runner.num_state_slots,
                num_state_snapshots=self.runner.num_state_snapshots,
                is_pooling=self.runner.pooling is not None,
                pools_whole_prompt=self.runner.pooling is not None and self.runner.pooling.whole_prompt,
                images_whole=self.runner.images_whole,
                service_cpu_cores=list(self.service_cores),
            )
        )
        while True:
            msg = self.from_scheduler.recv()
            if isinstance(msg, Shutdown):
                return
            if msg is not None:
                reply = self.handle(msg)
                if reply is not None:
                    self.to_scheduler.send(reply)

    def handle(self, msg: SchedulerToWorker) -> msgspec.Struct | None:
        if isinstance(msg, ForwardBatch):
            return self.run_batch(msg)
        if isinstance(msg, DropAdapters):
            if self.runner.lora is not None:
                self.runner.lora.drop(msg.lora_ids)
            if self.runner.draft_adapters is not None:  # their draft adapters go with them
                self.runner.draft_adapters.drop(msg.lora_ids)
            return None
        raise TypeError(f"unexpected message {type(msg).__name__}")

    def run_batch(self, batch: ForwardBatch) -> BatchResult | None:
        # Every rank runs the batch (the collectives need them all); rank 0's tokens are the ones sent. A bad batch
        # fails on every rank alike, before any collective, since all ranks see the same batch. That holds for adapter
        # slots too: the scheduler only names adapters that every rank loaded (it drops partial loads everywhere).
        # Any other error (a failed or timed-out collective, a device fault, a bug) leaves this rank's state or the
        # group's unknown: it propagates, and the worker reports it and exits (main) rather than serve on it.
        self.inject_faults()
        try:
            batch = with_sampled_tokens(batch, self.last_token_ids)
            step, error_message = self.runner.step(batch), ""
            next_token_ids, logprobs, prompt_logprobs, pooled, accepted_ids, accepted_logprobs = step
        except BatchError as e:  # the batch itself is wrong: the message says it all
            logger.error("batch %d rejected: %s", batch.batch_id, e)
            next_token_ids, logprobs, prompt_logprobs, pooled, accepted_ids, accepted_logprobs = [], [], [], [], [], []
            error_message = f"{type(e).__name__}: {e}"
        # Every rank samples the same tokens (same logits, same generators), so each keeps its own copy.
        self.last_token_ids = next_token_ids
        if self.tp_rank != 0:
            return None
        return BatchResult(batch_id=batch.batch_id, next_token_ids=next_token_ids, error_message=error_message,
                           logprobs=logprobs, prompt_logprobs=prompt_logprobs, pooled=pooled,
                           accepted_ids=accepted_ids, accepted_logprobs=accepted_logprobs)

    def inject_faults(self) -> None:
        if self.stall_forward_s:
            time.sleep(self.stall_forward_s)
        if self.crash_forward:
            raise RuntimeError(f"injected fault on rank {self.tp_rank}")

    def close(self) -> None:
        self.loader.stop()
        self.from_scheduler.close()
        self.to_scheduler.close()
        destroy_distributed()


def with_sampled_tokens(batch: ForwardBatch, last_token_ids: list[int]) -> ForwardBatch:
    """The scheduler sends a pass before the previous one returned: a request whose next token that pass samples
    names its row there (prev_row), and the token is put in here, where it is known."""
    if all(req.prev_row < 0 for req in batch.reqs):
        return batch
    reqs = []
    for i, req in enumerate(batch.reqs):
        if req.prev_row >= 0:
            if req.prev_row >= len(last_token_ids):
                raise BatchError(f"request {i} reads row {req.prev_row} of the previous batch, which sampled "
                                 f"{len(last_token_ids)} tokens")
            req = msgspec.structs.replace(req, input_ids=[last_token_ids[req.prev_row]], prev_row=-1)
        reqs.append(req)
    return msgspec.structs.replace(batch, reqs=reqs)


def main() -> int:
    args = read_process_args()
    die_with_parent()
    config = args.config
    tp_rank = global_rank(config, args.local_rank)
    setup_logging(config.log_level, f"worker{tp_rank}")
    key = ClusterKey.of(config.cluster_key_file)  # CURVE on the TCP sockets to and from node 0
    to_scheduler = TypedSocket(PUSH, args.endpoints.workers_to_scheduler, bind=False, key=key)
    try:
        worker = Worker(args, tp_rank, to_scheduler, read_fault_plan(), key)
    except Exception as e:
        # a configuration the device cannot run or a checkpoint that cannot be served, not a fault: its line says it
        if isinstance(e, (BackendError, CheckpointError, QuantFormatError)):
            logger.error("start-up failed: %s", e)
        else:
            logger.exception("start-up failed")
        to_scheduler.send(ProcessFailed(who=f"worker{tp_rank}", error_message=f"{type(e).__name__}: {e}"))
        to_scheduler.sock.close(linger=FAILURE_FLUSH_MS)
        return 1
    try:
        worker.serve()
    except Exception as e:
        logger.exception("worker failed: exiting")
        failed = ProcessFailed(who=f"worker{tp_rank}", error_message=f"{type(e).__name__}: {e}")
        send_last(args.endpoints.workers_to_scheduler, failed, FAILURE_FLUSH_MS, key)
        # No orderly teardown: the process group may be mid-collective and broken; exiting must not wait on it.
        os._exit(1)
    logger.info("shutting down")
    worker.close()
    return 0
