"""A headless node (--nnodes > 1, --node-rank > 0): this node's ranks, and `GET /health` on its own --host/--port.

Its ranks join node 0's process group and serve node 0's scheduler over TCP (cluster/node_rendezvous.py); adapters
reach them as raw tensor frames, so no adapter path is read here. /health takes no key: 200 while every rank here is
alive and node 0 serves (it has said it is ready and not that it stopped), else 503; any other path is a 404. Once
node 0 is unreachable, or says it stopped, the ranks are stopped and the process exits: 0 when the ranks had
already ended cleanly (node 0's orderly shutdown reached them), else 1, within NODE_LOST_EXIT_S at most.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from aiohttp import web
from loraplex.frontend.cluster.node_rendezvous import BEAT_INTERVAL_S, NodeRendezvous
from loraplex.frontend.cluster.process_group import ProcessGroup
from loraplex.frontend.model_files import ModelFiles
from loraplex.frontend.runtime import START_TIMEOUT_S
from loraplex.protocol.config import ServerConfig

logger = logging.getLogger("loraplex.headless")

RANKS_EXIT_GRACE_S = 5.0  # node 0 stopped serving: how long the ranks get to end on their own (its Shutdown)


class HeadlessNode:
    def __init__(self, config: ServerConfig, model_files: ModelFiles):
        self.config = config
        self.model_files = model_files  # resolved (downloaded) by this node's launcher
        self.unhealthy_reason: str | None = "starting"  # None: healthy
        self.procs: ProcessGroup | None = None

    async def health(self, request: web.Request) -> web.Response:
        if self.unhealthy_reason is None:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unhealthy", "reason": self.unhealthy_reason}, status=503)

    async def run(self) -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        app = web.Application()
        app.router.add_get("/health", self.health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, self.config.host, self.config.port).start()
        logger.info("node %d: /health on http://%s:%d", self.config.node_rank, self.config.host, self.config.port)
        try:
            nodes = await loop.run_in_executor(None, NodeRendezvous, self.config, START_TIMEOUT_S,
                                               self.model_files.revision)
            endpoints, ranks_config = await loop.run_in_executor(None, nodes.join_endpoints, START_TIMEOUT_S)
            self.procs = ProcessGroup(ranks_config, self.model_files.model_dir)
            self.procs.endpoints = [endpoints]
            self.procs.start()
            return await self.watch(nodes, stop)
        finally:
            self.unhealthy_reason = "stopping"
            if self.procs is not None:
                await loop.run_in_executor(None, self.procs.stop)
            await runner.cleanup()

    async def watch(self, nodes: NodeRendezvous, stop: asyncio.Event) -> int:
        """Beat until SIGTERM (0), node 0 lost or stopped, or a rank here ended; the exit code."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            try:
                ready, failed = await loop.run_in_executor(None, nodes.beat)
            except Exception as e:  # noqa: BLE001 - any store error: node 0 is gone
                logger.error("lost node 0: %s", e)
                return 1
            dead = self.procs.dead()
            if failed is not None or dead is not None:
                self.unhealthy_reason = failed or f"{dead[0]} exited with code {dead[1]}"
                logger.info("stopping: %s", self.unhealthy_reason)
                return await loop.run_in_executor(None, self.ranks_exit_code)
            self.unhealthy_reason = None if ready else "waiting for node 0"
            try:
                await asyncio.wait_for(stop.wait(), BEAT_INTERVAL_S)
            except asyncio.TimeoutError:
                pass
        return 0

    def ranks_exit_code(self) -> int:
        """0 if every rank here ends cleanly within RANKS_EXIT_GRACE_S (node 0's Shutdown reached it), else 1."""
        deadline = time.monotonic() + RANKS_EXIT_GRACE_S
        while time.monotonic() < deadline and any(code is None for code in self.procs.exit_codes().values()):
            time.sleep(0.1)
        return 0 if all(code == 0 for code in self.procs.exit_codes().values()) else 1


async def serve_headless(config: ServerConfig, model_files: ModelFiles) -> int:
    return await HeadlessNode(config, model_files).run()
