"""llama-server's side of the speculative benchmark (scripts/bench/spec_llama_cpp.py) against a stand-in server in
process: greedy probes and timed streams name each request's adapter by id, acceptance is read from the responses'
timings, each side's flags are llama.cpp's speculative ones, and the table's loraplex / llama-server rows compare a
side with the same side."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

import scripts.bench.spec_llama_cpp as spec_llama
import scripts.bench.speculative as speculative
from scripts.bench import ratios
from scripts.bench.llama_cpp import llama_server_command
from scripts.bench.serving import run_requests
from scripts.bench.workload import BenchRequest
from tests.net import free_port

ADAPTER_IDS = {"reverse": 0, "sort": 1}
# the stand-in's greedy answer for each adapter id (none: the base)
ANSWERS = {None: [40, 41, 42], 0: [50, 51], 1: [60]}


def answer_of(body: dict) -> list[int]:
    return ANSWERS[body["lora"][0]["id"] if body["lora"] else None]


async def with_stand_in(work, *, extra_bos: bool = False):
    """Runs `work(url)` against a stand-in llama-server's /completion (its non-OAI replies, streamed or not);
    (work's result, the request bodies)."""
    bodies: list[dict] = []

    async def completion(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        bodies.append(body)
        evaluated = len(body["prompt"]) + extra_bos
        if not body.get("stream"):
            return web.json_response({"tokens": answer_of(body), "stop": True, "tokens_evaluated": evaluated,
                                      "tokens_predicted": len(answer_of(body))})  # fmt: skip
        resp = web.StreamResponse()
        await resp.prepare(request)
        for n in range(1, body["n_predict"] + 1):
            chunk = {"content": "x", "tokens": [7], "stop": False, "tokens_predicted": n}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        # a response that drafted reports draft_n / draft_n_accepted; one that did not, neither
        timings = {"predicted_n": body["n_predict"]} | (
            {"draft_n": 2 * body["n_predict"], "draft_n_accepted": body["n_predict"]} if body["lora"] else {})
        final = {"content": "", "stop": True, "tokens_predicted": body["n_predict"], "timings": timings}
        await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/completion", completion)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        return await work(f"http://127.0.0.1:{port}"), bodies
    finally:
        await runner.cleanup()


def test_greedy_probe_names_each_adapter_and_stops_at_eos():
    runs = [([1, 5, 6], "reverse"), ([1, 7], None), ([1, 8, 9, 10], "sort")]
    tokens, bodies = asyncio.run(with_stand_in(
        lambda url: spec_llama.greedy_tokens(url, runs, ADAPTER_IDS, max_tokens=32, concurrency=2)))  # fmt: skip
    assert tokens == [[50, 51], [40, 41, 42], [60]]  # in the prompts' order
    by_prompt = {tuple(b["prompt"]): b for b in bodies}
    assert by_prompt[(1, 5, 6)]["lora"] == [{"id": 0, "scale": 1.0}] and by_prompt[(1, 7)]["lora"] == []
    # greedy to the model's own EOS: no ignore_eos (llama.cpp's bans EOS), the token ids returned
    assert all(b["temperature"] == 0.0 and b["return_tokens"] and b["n_predict"] == 32 and "ignore_eos" not in b
               for b in bodies)  # fmt: skip
    # answers are compared without their closing EOS
    assert spec_llama.without_eos([50, 51, 2], eos=2) == [50, 51] and spec_llama.without_eos([50], eos=2) == [50]


def test_a_prompt_the_server_changes_is_refused():
    with pytest.raises(RuntimeError, match="evaluated 4 prompt tokens of 3"):
        asyncio.run(with_stand_in(lambda url: spec_llama.greedy_tokens(url, [([1, 5, 6], None)], ADAPTER_IDS, 8, 1),
                                  extra_bos=True))  # fmt: skip


def test_timed_streams_count_tokens_and_read_acceptance_from_timings():
    requests = [BenchRequest(0, [1, 5], 4, "reverse", 0.0), BenchRequest(1, [1, 6], 3, None, 0.0),
                BenchRequest(2, [1, 7], 2, "sort", 0.0)]  # fmt: skip
    timings: list[dict] = []
    wire = spec_llama.timed_wire(ADAPTER_IDS, timings)
    (results, _), bodies = asyncio.run(with_stand_in(
        lambda url: run_requests(url, requests, concurrency=2, progress=False, wire=wire)))  # fmt: skip
    assert [r.num_output_tokens for r in results] == [4, 3, 2] and all(r.ok for r in results)
    assert all(b["ignore_eos"] and b["stream"] for b in bodies)  # the same output lengths as loraplex's side
    assert len(timings) == 3  # one final chunk each
    assert spec_llama.acceptance(timings) == (2 * (4 + 2), 4 + 2)  # the base request drafted nothing


def value(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def test_each_side_runs_llama_cpps_own_speculative_mode(tmp_path: Path):
    draft = tmp_path / "draft.gguf"
    assert spec_llama.side_flags("off", 4, draft) == []
    ngram = spec_llama.side_flags("ngram", 4, draft)
    assert value(ngram, "--spec-type") == "ngram-simple" and value(ngram, "--spec-ngram-simple-size-m") == "4"
    assert str(draft) not in ngram
    drafted = spec_llama.side_flags("draft_model", 3, draft)
    assert value(drafted, "--spec-type") == "draft-simple" and value(drafted, "-md") == str(draft)
    assert value(drafted, "--spec-draft-n-max") == "3" and value(drafted, "--spec-draft-p-min") == "0"
    with pytest.raises(ValueError, match="unknown side"):
        spec_llama.side_flags("eagle3", 3, draft)
    cmd = llama_server_command(tmp_path, tmp_path / "base.gguf", [tmp_path / "a.gguf"], threads=2, slots=8, port=1,
                               extra=drafted)  # fmt: skip
    assert cmd[-len(drafted):] == drafted and value(cmd, "-np") == "8"
    assert spec_llama.OUTTYPES["float32"] == "f32"  # the conversion follows loraplex's --dtype


def side(throughput: float, rate: float) -> dict:
    return {"summary": {"output_token_throughput": throughput}, "acceptance_rate": rate, "mean_accepted_length": 2.0}


def test_the_table_puts_each_loraplex_side_beside_the_same_llama_server_side():
    results = {f"{s}_{w}_{n}": side(10.0 * (1 + i), 0.5) for i, s in enumerate(spec_llama.SIDES)
               for w in speculative.WORKLOADS for n in speculative.STREAMS}  # fmt: skip
    table = ratios.rows("speculative", {"measured": speculative.measure_ratios(results)})
    assert len(table) == len(speculative.TARGETS)  # without --llama-cpp: the table as before
    results |= {f"llama_{s}_{w}_{n}": side(5.0, 0.25) for s in spec_llama.SIDES
                for w in speculative.WORKLOADS for n in speculative.STREAMS}  # fmt: skip
    measured = speculative.measure_ratios(results)
    ratio, words = measured["llama_draft_model_new_text_8"]
    assert ratio == pytest.approx(30.0 / 5.0) and words == "30.0 vs 5.0 out tok/s (acceptance 50% vs 25%)"
    assert measured["llama_off_repetitive_1"][0] == pytest.approx(10.0 / 5.0)
    rows = {row[0]: row for row in ratios.rows("speculative", {"measured": measured})}
    assert len(rows) == len(speculative.TARGETS) + len(speculative.OPTIONAL_TARGETS)
    draft_row = next(row for label, row in rows.items() if "llama-server" in label and "draft model" in label)
    assert "no adapter on its draft" in draft_row[0] and draft_row[3] == "n/a"  # no target: beside, not judged


def test_llama_cpp_is_an_option_of_the_speculative_benchmark():
    parser = argparse.ArgumentParser()
    dests = speculative.add_arguments(parser)
    assert dests == ["llama_cpp"]
    assert parser.parse_args([]).llama_cpp is None
    assert parser.parse_args(["--llama-cpp", "/x"]).llama_cpp == Path("/x")
