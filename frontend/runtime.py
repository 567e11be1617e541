"""Runtime: the frontend's lifecycle — start the child processes, own the pieces (tokenizer, adapter registry and
manager, replicas, router, metrics), watch the children, drain on SIGTERM, fail whole, shut down.

Every entry point drives one Runtime from one event loop through its one GenerateService (frontend/generate.py),
which owns the table of requests in flight (frontend/request_table.py) and attaches it here: the schedulers' token
deltas go to it, and a drain or a failure ends what it holds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from loraplex.frontend.adapters.audit import AuditLog
from loraplex.frontend.adapters.manager import AdapterManager
from loraplex.frontend.adapters.registry import AdapterRegistry
from loraplex.frontend.adapters.state_file import AdapterStateFile
from loraplex.frontend.adapters.tokenizers import AdapterTokenizers, Vocabulary
from loraplex.frontend.chat_template import load_chat_template
from loraplex.frontend.cluster.node_rendezvous import NodeRendezvous
from loraplex.frontend.cluster.process_group import ProcessGroup
from loraplex.frontend.cluster.replica_set import ReplicaSet
from loraplex.frontend.cluster.router import Router
from loraplex.frontend.grammar_checker import GrammarChecker
from loraplex.frontend.lora_config import resolve_lora_config
from loraplex.frontend.metrics import Metrics
from loraplex.frontend.model_files import ModelFiles, resolve_model_files
from loraplex.frontend.multimodal.images import ImagePipeline
from loraplex.frontend.rate_limits import KeyRateLimits
from loraplex.frontend.request_table import RequestTable
from loraplex.protocol import cpu_cores
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.pooling import PoolingSpec, resolve_pooling
from loraplex.protocol.quantization import read_hf_config, resolve_quantization
from loraplex.protocol.structs import LoRAAdapterSpec, SchedulerReady, SlotsChanged, TokenDeltas

logger = logging.getLogger("loraplex.runtime")

START_TIMEOUT_S = 600.0
WATCH_INTERVAL_S = 0.2
DRAIN_POLL_S = 0.05
# After a drain aborts what is left, how long the handlers get to write their last chunk and call finish().
ABORT_GRACE_S = 3.0


class Runtime:
    def __init__(self, config: ServerConfig, model_files: ModelFiles | None = None):
        """model_files: the model's local files when the launcher already has them (downloaded before anything
        starts); else start() resolves them, downloading from the Hub if need be."""
        self.config = config
        self.model_files = model_files
        self.created = int(time.time())  # the base model's card's `created`
        self.registry = AdapterRegistry(config.lora_path_root, max_pinned=config.max_loras_per_batch - 1)
        self.metrics = Metrics(config.model_name, config.dp_size)
        self.rate_limits = KeyRateLimits(config.max_requests_per_minute_per_key, config.max_tokens_per_minute_per_key)
        self.requests: RequestTable | None = None  # the GenerateService's, attached when it is built
        self.ready: SchedulerReady | None = None  # what every replica can take (the smallest KV cache)
        self.replica_ready: list[SchedulerReady] = []  # by dp_rank
        self.started = False  # every process up and start-up adapters loaded
        self.draining = False  # SIGTERM: no new work, the requests in flight finish (drain)
        self.stopping = False
        self.failure: str | None = None  # set once a child process died
        self._children_stopped: asyncio.Future | None = None  # the survivors of a failure, being stopped
        self.model_dir = ""
        self.pooling: PoolingSpec | None = None  # the pooling runner's spec, once started (protocol/pooling.py)
        self.quantization: str | None = None  # the checkpoint's method in use (protocol/quantization.py)
        self.tokenizer: Any = None
        self.chat_template = load_chat_template(config.chat_template)  # None: the tokenizer's own
        self.eos_token_ids: list[int] = []
        self.vocabulary: Vocabulary | None = None  # the three above, as requests on no adapter of its own use them
        self.images: ImagePipeline | None = None  # a request's images to its prompt (None until started)
        self.grammars = GrammarChecker()  # structured-output constraints compile before their request is admitted
        self.procs: ProcessGroup | None = None
        self.replicas: ReplicaSet | None = None
        self.nodes: NodeRendezvous | None = None  # --nnodes > 1: the other nodes' endpoints and heartbeats
        self.router = Router(config.dp_size)
        self.adapters: AdapterManager | None = None  # built once the LoRA config is complete (start)
        self.audit = AuditLog(config.audit_log)  # before start: refusals at the edges are recorded from the first one
        self._watch_task: asyncio.Task | None = None
        self._cores_before: list[int] = []  # this process's cores before start() kept it off the compute cores

    def attach(self, requests: RequestTable) -> None:
        """The GenerateService's table of requests in flight: one service per Runtime, so one table."""
        if self.requests is not None:
            raise RuntimeError("this Runtime already serves a GenerateService; share that one")
        self.requests = requests

    # ---- start / stop -------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.model_files is None:
            logger.info("resolving model %s", self.config.model_path)
            self.model_files = await loop.run_in_executor(None, resolve_model_files, self.config)
        self.model_dir = self.model_files.model_dir
        self.pooling = resolve_pooling(self.config, self.model_dir)  # None: the generate runner
        self.config = resolve_lora_config(self.config, self.model_dir)
        self.quantization = resolve_quantization(self.config.quantization, read_hf_config(self.model_dir))
        logger.info("quantization: %s (--quantization %s)", self.quantization or "none", self.config.quantization)
        self.images = await loop.run_in_executor(None, ImagePipeline.load, self.model_dir, self.config)
        self.procs = ProcessGroup(self.config, self.model_dir)
        if self.config.nnodes > 1:  # every rank's endpoints, the remote ones as their nodes published them
            self.nodes = await loop.run_in_executor(None, NodeRendezvous, self.config, START_TIMEOUT_S,
                                                    self.model_files.revision)
            endpoints = await loop.run_in_executor(None, self.nodes.host_endpoints, self.procs.ipc_dir,
                                                   START_TIMEOUT_S)
            self.procs.endpoints = [endpoints]
        self.replicas = ReplicaSet(self.procs.endpoints, self._apply_deltas, self._on_slots, self._on_failure)
        state_file = AdapterStateFile(self.config.lora_state_file) if self.config.lora_state_file else None
        self.adapters = AdapterManager(self.config, self.registry, self.metrics, self.replicas, state_file,
                                       self.audit)
        self.procs.start()
        tokenizer_dir = self.model_files.tokenizer_dir
        logger.info("loading tokenizer from %s", tokenizer_dir)
        self.tokenizer, self.eos_token_ids = await loop.run_in_executor(None, load_tokenizer, tokenizer_dir,
                                                                        self.model_dir)
        self.replica_ready = await self.replicas.wait_ready(self._dead, START_TIMEOUT_S)
        self.ready = min(self.replica_ready, key=lambda ready: ready.max_total_tokens)
        if self.ready.service_cpu_cores:  # off the ranks' pinned compute threads; given back at shutdown (an Engine
            self._cores_before = sorted(os.sched_getaffinity(0))  # runs in its caller's process)
            cpu_cores.pin_to(self.ready.service_cpu_cores)
        self.vocabulary = Vocabulary(self.tokenizer, self.chat_template, self.eos_token_ids)
        self.adapters.tokenizers = AdapterTokenizers(self.vocabulary, self.ready.vocab_size)
        logger.info(
            "scheduler ready: model_type %s, %d hidden layers, load format %s, %d KV tokens, context length %d",
            self.ready.model_type, self.ready.num_hidden_layers, self.config.load_format, self.ready.max_total_tokens,
            self.ready.context_length,
        )  # fmt: skip
        self._watch_task = asyncio.create_task(self._watch_loop())
        sources = self.config.lora_sources
        specs = [LoRAAdapterSpec(lora_name=s.lora_name, lora_path=s.lora_path, pinned=s.pinned) for s in sources]
        parents = {s.lora_name: s.base_model_name for s in sources if s.base_model_name}
        await self.adapters.load_startup(specs, parents)
        self.started = True
        if self.nodes is not None:
            self.nodes.set_ready()
        logger.info("server ready")

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work at once (health and new requests 503), let the requests in flight finish for up to
        timeout_s, then end the rest with finish reason abort. The processes keep running: shutdown() stops them."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        logger.info("draining %d request(s) for up to %.0f s", len(self.requests), timeout_s)
        while self.requests and self.failure is None and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        num_left = await self.requests.abort_unfinished("server is shutting down")
        if num_left:
            logger.info("aborting %d request(s) still running after %.0f s", num_left, timeout_s)
        deadline = loop.time() + ABORT_GRACE_S
        while self.requests and loop.time() < deadline:  # the handlers send their last chunk, then finish()
            await asyncio.sleep(DRAIN_POLL_S)

    async def shutdown(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        if self._watch_task is not None:
            self._watch_task.cancel()
        self._fail_all("server is shutting down", status=503)
        if self.replicas is not None:
            await self.replicas.close(send_shutdown=self.failure is None)
        if self.nodes is not None:  # after the Shutdown went to every rank: the headless nodes may go too
            self.nodes.set_failed("node 0 shut down")
        if self._children_stopped is not None:
            await self._children_stopped
        if self.procs is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.procs.stop)
        if self.replicas is not None:
            self.replicas.close_sockets()
        self.audit.close()
        if self.images is not None:
            self.images.close()
        cpu_cores.pin_to(self._cores_before)

    @property
    def healthy(self) -> bool:
        return self.started and not self.draining and not self.stopping and self.failure is None

    # ---- background ------------------------------------------------------------------------------------

    async def _apply_deltas(self, msg: TokenDeltas) -> None:
        await self.requests.apply_deltas(msg)

    def _on_slots(self, dp_rank: int, msg: SlotsChanged) -> None:
        self.router.set_resident(dp_rank, msg.slot_lora_ids)

    async def _watch_loop(self) -> None:
        while self.failure is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
            dead = self._dead()
            if dead is not None and not self.stopping:
                self._on_failure(dead[0] if dead[1] == -1 else f"{dead[0]} exited with code {dead[1]}")

    def _dead(self) -> tuple[str, int] | None:
        """A child that exited, or a node that stopped beating: (who, exit code; -1 for a node)."""
        dead = self.procs.dead()
        if dead is None and self.nodes is not None and (node := self.nodes.dead_node()) is not None:
            return f"lost {node}", -1
        return dead

    def _on_failure(self, reason: str) -> None:
        if self.failure is None:
            logger.error("server unhealthy: %s", reason)
            self.failure = reason
            if self.nodes is not None:  # the headless nodes stop their ranks too
                self.nodes.set_failed(reason)
            # No partial serving: the surviving children are stopped now; the frontend answers 503 until SIGTERM.
            if self.procs is not None and not self.stopping:
                logger.error("stopping the remaining processes; serving 503 until SIGTERM")
                self._children_stopped = asyncio.get_running_loop().run_in_executor(None, self.procs.stop)
        self._fail_all(f"server failure: {reason}", status=503)
        if self.replicas is not None:
            self.replicas.fail_pending(reason)

    def _fail_all(self, message: str, status: int) -> None:
        if self.requests is not None:
            self.requests.fail_all(message, status)


def load_tokenizer(tokenizer_dir: str, model_dir: str) -> tuple[Any, list[int]]:
    import json
    import os

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos: set[int] = set()
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            value = json.load(f).get("eos_token_id")
        eos.update(value if isinstance(value, list) else [value] if value is not None else [])
    return tokenizer, sorted(eos)
