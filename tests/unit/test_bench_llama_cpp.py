"""The llama.cpp side-by-side benchmark's client: llama-server's streamed /completion chunks counted as tokens, each
request's adapter named by id at scale 1, and the workloads both servers get (a stand-in server, in process)."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from scripts.bench.llama_cpp import FULL, llama_cpp_wire, workloads
from scripts.bench.serving import run_requests
from scripts.bench.workload import BenchRequest
from tests.net import free_port


def chunk(**fields: object) -> bytes:
    return b"data: " + json.dumps(fields).encode() + b"\n\n"


async def serve_and_run(requests: list[BenchRequest], wire) -> tuple[list, list[dict]]:
    bodies: list[dict] = []

    async def completion(request: web.Request) -> web.StreamResponse:  # llama-server's non-OAI stream, one per token
        body = await request.json()
        bodies.append(body)
        resp = web.StreamResponse()
        await resp.prepare(request)
        for n in range(1, body["n_predict"] + 1):
            await resp.write(chunk(content="x", tokens=[7], stop=False, tokens_predicted=n, tokens_evaluated=3))
        await resp.write(chunk(content="", stop=True, tokens_predicted=body["n_predict"], timings={}))
        return resp

    app = web.Application()
    app.router.add_post("/completion", completion)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        results, _ = await run_requests(f"http://127.0.0.1:{port}", requests, concurrency=2, progress=False, wire=wire)
    finally:
        await runner.cleanup()
    return results, bodies


def test_llama_server_chunks_count_as_tokens_and_name_the_adapter():
    requests = [BenchRequest(0, [5, 6, 7], 4, "a", 0.0), BenchRequest(1, [8], 2, "b", 0.0),
                BenchRequest(2, [9, 9], 3, None, 0.0)]
    results, bodies = asyncio.run(serve_and_run(requests, llama_cpp_wire({"a": 0, "b": 1})))
    assert [r.ok for r in results] == [True] * 3, [r.error for r in results]
    assert [r.num_output_tokens for r in results] == [4, 2, 3]
    assert all(len(r.itl_s) == r.output_len - 1 for r in results)  # one gap per token after the first
    by_prompt = {tuple(b["prompt"]): b for b in bodies}
    assert by_prompt[(5, 6, 7)]["lora"] == [{"id": 0, "scale": 1.0}]
    assert by_prompt[(8,)]["lora"] == [{"id": 1, "scale": 1.0}]
    assert by_prompt[(9, 9)]["lora"] == []  # the base: every adapter stays at its global scale of 0
    assert all(b["ignore_eos"] and b["stream"] and not b["cache_prompt"] for b in bodies)


def test_both_servers_get_the_same_workloads():
    names = [f"lora-{i:03d}" for i in range(32)]
    runs = workloads(FULL, names, seed=0)
    single, concurrency = runs["single"]
    assert concurrency == 1 and len(single) == FULL.single_requests
    assert {len(r.input_ids) for r in single} == {64} and {r.output_len for r in single} == {FULL.single_output}
    assert [r.adapter for r in single] == [names[i % 4] for i in range(len(single))]
    mixed, concurrency = runs["adapters"]
    assert concurrency == 32 and len(mixed) == FULL.num_requests
    assert all(16 <= len(r.input_ids) <= 256 and 16 <= r.output_len <= 256 for r in mixed)
    assert workloads(FULL, names, seed=0)["adapters"][0] == mixed  # the same requests on both sides
