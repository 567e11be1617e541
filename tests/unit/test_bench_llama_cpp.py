"""The llama.cpp side-by-side benchmark's client: llama-server's streamed /completion chunks counted as tokens, each
request's adapter named by id at scale 1, and the workloads both servers get (a stand-in server, in process)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
import requests
from aiohttp import web

from scripts.bench.llama_cpp import (
    CONVERT,
    FULL,
    _run,
    best_of,
    llama_cpp_wire,
    llama_server_command,
    rows,
    start_llama_server,
    workloads,
)
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


# A stand-in llama-server: dies at start as llama.cpp's repacked kernels do on some CPUs, unless given --no-repack;
# then answers /health and /lora-adapters. It records its command line.
FAKE_SERVER = """#!{python}
import http.server, json, sys
argv = sys.argv[1:]
open({record!r}, "a").write(json.dumps(argv) + "\\n")
if "--no-repack" not in argv:
    sys.exit(134)
class Handler(http.server.BaseHTTPRequestHandler):
    def reply(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{{}}")
    do_GET = do_POST = reply
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler).serve_forever()
"""


def test_a_server_that_dies_at_start_is_retried_with_no_repack(tmp_path: Path) -> None:
    record = tmp_path / "argv.jsonl"
    binary = tmp_path / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text(FAKE_SERVER.format(python=sys.executable, record=str(record)))
    binary.chmod(0o755)
    adapters = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    with start_llama_server(tmp_path, tmp_path / "base.gguf", adapters, threads=2, slots=4) as server:
        assert server.no_repack
        assert requests.get(server.url + "/health", timeout=5).status_code == 200
    first, retry = (json.loads(line) for line in record.read_text().splitlines())
    assert "--no-repack" not in first and retry[retry.index("--no-repack") - 1] == "0"  # after --cache-ram 0
    for argv in (first, retry):  # the adapters as one comma-separated list
        assert argv.count("--lora") == 1 and argv[argv.index("--lora") + 1] == f"{adapters[0]},{adapters[1]}"
    assert rows({"plan": {"num_adapters": 4}, "no_repack": {"8-bit": True},
                 "best": {"8-bit": {side: {"single_tok_s": 1.0, "adapters_tok_s": 1.0, "adapters_ttft_p99_ms": 1.0}
                                    for side in ("loraplex", "llama.cpp")}}})[0][0].startswith(
        "8-bit (llama-server --no-repack: it died at start without)")  # fmt: skip


def test_a_single_stream_run_tables_its_ratio_and_nothing_else() -> None:
    """--workloads single: each side's best is its fastest round, and the table has the single-stream rows only."""
    rounds = [{"single": {"itl_ms": {"mean": ms}}} for ms in (10.0, 8.0)]
    assert best_of(rounds) == {"single_tok_s": 125.0}
    table = rows({"plan": {"num_adapters": 32}, "best": {"bf16": {"loraplex": {"single_tok_s": 120.0},
                                                                  "llama.cpp": {"single_tok_s": 100.0}}}})
    assert table == [["bf16: single-stream decode tok/s", "1.20", "120.0 vs 100.0"]]


def test_the_command_line_refuses_a_path_with_a_comma(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="comma-separated"):
        llama_server_command(tmp_path, tmp_path / "b.gguf", [tmp_path / "x,y.gguf"], threads=1, slots=1, port=1)


def test_the_converter_shim_gives_a_bpe_without_merges_one_merge(tmp_path: Path) -> None:
    """CONVERT runs a converter of the tree; a stand-in tree's gguf writes what SpecialVocab would add: an empty
    merge list (the demo's one-character BPE) becomes one inert merge, llama.cpp refusing a BPE without merges;
    a real list (the bench tokenizer's) is left as it is."""
    (tmp_path / "gguf-py" / "gguf").mkdir(parents=True)
    (tmp_path / "gguf-py" / "gguf" / "__init__.py").write_text(
        "class SpecialVocab:\n"
        "    def __init__(self, merges):\n        self.merges, self.load_merges = merges, True\n"
        "    def add_to_gguf(self, written, quiet=False):\n        written.append(list(self.merges))\n")
    (tmp_path / "conversion").mkdir()
    (tmp_path / "conversion" / "__init__.py").write_text("")
    (tmp_path / "conversion" / "base.py").write_text("class TextModel:\n    pass\n")
    out = tmp_path / "written.json"
    (tmp_path / "convert_stand_in.py").write_text(
        "import json, sys, gguf\nwritten = []\n"
        "for merges in ([], ['a b']):\n    gguf.SpecialVocab(merges).add_to_gguf(written)\n"
        "open(sys.argv[1], 'w').write(json.dumps(written))\n")
    _run([sys.executable, "-c", CONVERT, "convert_stand_in.py", str(out)], tmp_path)
    assert json.loads(out.read_text()) == [["\u0120 \u0120"], ["a b"]]
