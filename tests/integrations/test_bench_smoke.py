"""The benchmark scripts stay runnable: a deterministic workload, bench_serving against a tiny server, and each
engine-core benchmark's --quick run (bench model, servers and all)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from loraplex.kernels import cpu_gemv
from loraplex.worker.quant.avx2 import Avx2IntMatmul

import scripts.bench.chunked_prefill as bench_chunked_prefill
import scripts.bench.decode_step as bench_decode_step
import scripts.bench.dp as bench_dp
import scripts.bench.families as bench_families
import scripts.bench.kv_admission as bench_kv_admission
import scripts.bench.prefix_cache as bench_prefix_cache
import scripts.bench.quantized as bench_quantized
import scripts.bench.roofline as bench_roofline
import scripts.bench.serving as bench_serving
import scripts.bench.step_overhead as bench_step_overhead
import scripts.bench.structured as bench_structured
from scripts.bench import ratios
from scripts.bench.report import percentile
from scripts.bench.workload import FIRST_PLAIN_TOKEN_ID, WorkloadSpec, make_workload
from tests.server_utils import ServerProcess

SPEC = WorkloadSpec(num_requests=64, input_len_range=(4, 40), output_len_range=(2, 30),
                    adapter_names=tuple(f"lora-{i:03d}" for i in range(8)), request_rate=20.0, seed=7)


def test_workload_is_deterministic() -> None:
    first, again = make_workload(SPEC), make_workload(SPEC)
    assert first == again
    assert make_workload(WorkloadSpec(**{**SPEC.__dict__, "seed": 8})) != first
    for r in first:
        assert 4 <= len(r.input_ids) <= 40 and 2 <= r.output_len <= 30
        assert all(FIRST_PLAIN_TOKEN_ID <= t < SPEC.vocab_size for t in r.input_ids)
    arrivals = [r.arrival_s for r in first]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and len(set(arrivals)) == len(arrivals)
    assert 1.0 < arrivals[-1] < 8.0  # 63 gaps of mean 1/20 s
    assert len({r.adapter for r in first}) == 8


def test_adapter_count_changes_only_the_adapter_column() -> None:
    many = make_workload(SPEC)
    for other in (make_workload(WorkloadSpec(**{**SPEC.__dict__, "adapter_names": ()})),
                  make_workload(WorkloadSpec(**{**SPEC.__dict__, "adapter_names": SPEC.adapter_names[:2]}))):
        assert [(r.input_ids, r.output_len, r.arrival_s) for r in other] == \
            [(r.input_ids, r.output_len, r.arrival_s) for r in many]
    assert {r.adapter for r in make_workload(WorkloadSpec(**{**SPEC.__dict__, "adapter_names": ()}))} == {None}


def test_zipf_favours_the_first_adapters() -> None:
    spec = WorkloadSpec(**{**SPEC.__dict__, "num_requests": 2000, "distribution": "zipf", "zipf_alpha": 1.5})
    counts = [sum(r.adapter == name for r in make_workload(spec)) for name in spec.adapter_names]
    assert counts[0] > 2 * counts[1] > 0 and counts[0] > 10 * counts[-1]


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)
    assert math.isnan(percentile([], 99))


def test_bench_serving_runs_against_a_tiny_server(llama_dir: Path, adapter_dirs: dict[str, Path],
                                                  tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    with ServerProcess("--model-path", str(llama_dir), "--lora-paths", f"a16={adapter_dirs['a16']}",
                       f"a4={adapter_dirs['a4']}", "--max-running-requests", "4") as server:
        bench_serving.main(["--url", server.url, "--adapter-names", "a16", "a4", "--num-adapters", "2",
                            "--num-requests", "6", "--concurrency", "3", "--input-len-range", "4", "12",
                            "--output-len-range", "3", "8", "--no-progress", "--json", str(out)])
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert summary["num_requests"] == summary["num_completed"] == 6 and summary["num_failed"] == 0
    workload = make_workload(WorkloadSpec(num_requests=6, input_len_range=(4, 12), output_len_range=(3, 8),
                                          adapter_names=("a16", "a4")))
    expected_tokens = sum(r.output_len for r in workload)
    assert summary["output_token_throughput"] * summary["duration_s"] == pytest.approx(expected_tokens)
    assert summary["request_throughput"] > 0
    for key in ("ttft_ms", "itl_ms", "e2e_latency_ms"):
        assert set(summary[key]) == {"p50", "p90", "p99", "mean"}
        assert 0 < summary[key]["p50"] <= summary[key]["p90"] <= summary[key]["p99"]
    assert summary["ttft_ms"]["p99"] <= summary["e2e_latency_ms"]["p99"]
    per_adapter = result["per_adapter"]
    assert set(per_adapter) == {r.adapter for r in workload}
    assert sum(s["num_completed"] for s in per_adapter.values()) == 6
    assert result["config"]["workload"]["adapter_names"] == ["a16", "a4"]


def test_system_prompts_prefix_the_same_user_turns() -> None:
    spec = WorkloadSpec(**{**SPEC.__dict__, "num_system_prompts": 3, "system_prompt_len": 20})
    plain, with_system = make_workload(SPEC), make_workload(spec)
    assert with_system == make_workload(spec)
    prefixes = {tuple(r.input_ids[:20]) for r in with_system}
    assert len(prefixes) == 3
    for r, p in zip(with_system, plain, strict=True):
        assert r.input_ids[20:] == p.input_ids  # the user turn is the prompt without system prompts
        assert (r.output_len, r.adapter, r.arrival_s) == (p.output_len, p.adapter, p.arrival_s)
    with pytest.raises(ValueError):
        WorkloadSpec(**{**SPEC.__dict__, "num_system_prompts": 3})


# ---- the engine-core benchmarks, each as `--quick` runs it (bench/all.py runs the same functions) -------------


@pytest.fixture(scope="module")
def bench_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench-model")


def run_quick(module, cache_dir: Path, out: Path) -> dict:
    """`python -m scripts.bench NAME --quick`, NAME the module's row of scripts/bench/ratios.py."""
    ratios.main(module.__name__.rsplit(".", 1)[1], ["--quick", "--cache-dir", str(cache_dir), "--json", str(out)])
    return json.loads(out.read_text())


def test_prefix_cache_quick(bench_cache_dir: Path, tmp_path: Path) -> None:
    result = run_quick(bench_prefix_cache, bench_cache_dir, tmp_path / "prefix.json")
    plan = bench_prefix_cache.QUICK
    for side in ("cache_on", "cache_off"):
        assert result[side]["summary"]["num_completed"] == plan.num_requests
    # Two prefixes per adapter among 24 requests: most prompts find their system prompt cached; none when it is off.
    assert result["cache_on"]["prefix_cache_hit_share"] > 0.5
    assert result["cache_off"]["prefix_cache_hit_share"] == 0
    assert set(result["measured"]) == set(bench_prefix_cache.TARGETS)
    assert all(value > 0 for value, _ in result["measured"].values())


def test_chunked_prefill_quick(bench_cache_dir: Path, tmp_path: Path) -> None:
    result = run_quick(bench_chunked_prefill, bench_cache_dir, tmp_path / "chunked.json")
    plan = bench_chunked_prefill.QUICK
    assert result["interval_s"] == max(plan.min_interval_s, 2 * result["lone_prefill_ms"]["whole"] / 1e3)
    for side in ("whole", "chunked"):
        assert result[side]["num_gaps"] > plan.num_streams  # the streams decoded through the window
        assert result[side]["stream_itl_ms"]["p99"] >= result[side]["stream_itl_ms"]["p50"] > 0
    [(value, _)] = result["measured"].values()
    assert value > 0


def test_kv_admission_quick(bench_cache_dir: Path, tmp_path: Path) -> None:
    result = run_quick(bench_kv_admission, bench_cache_dir, tmp_path / "kv.json")
    best, plan = result["best"], bench_kv_admission.QUICK
    assert best["max_total_tokens"] == plan.max_total_tokens
    assert best["max_total_tokens"] // best["context_length"] == 2  # the old rule's limit here
    # Short chats take pages for what they have: every one runs at once, far past the old limit.
    assert best["peak_running"] == plan.num_chats
    assert best["left_running_after_abort"] == 0  # cut-off chats give everything back
    assert result["measured"]["kv_admission"][0] == plan.num_chats / 2


def test_step_overhead_quick(bench_cache_dir: Path, tmp_path: Path) -> None:
    result = run_quick(bench_step_overhead, bench_cache_dir, tmp_path / "step.json")
    stream, plan = result["stream"], bench_step_overhead.QUICK
    assert stream["num_completed"] == 1
    assert stream["output_token_throughput"] * stream["duration_s"] == pytest.approx(plan.output_len)
    assert result["step_ms"] > 0 and stream["itl_ms"]["p50"] > 0
    [(value, _)] = result["measured"].values()
    assert value == pytest.approx(stream["itl_ms"]["p50"] / result["step_ms"])


def test_data_parallel_quick(bench_cache_dir: Path, tmp_path: Path) -> None:
    result = run_quick(bench_dp, bench_cache_dir, tmp_path / "dp.json")
    plan = bench_dp.QUICK
    for side in ("dp1", "dpN"):
        assert result[side]["summary"]["num_completed"] == plan.num_requests
    assert len(result["dp1"]["requests_routed"]) == 1
    assert len(result["dpN"]["requests_routed"]) == plan.dp_size and min(result["dpN"]["requests_routed"]) > 0


def test_structured_quick(bench_cache_dir: Path, tmp_path: Path) -> None:
    result = run_quick(bench_structured, bench_cache_dir, tmp_path / "structured.json")
    plan = bench_structured.QUICK
    for side in ("free", "constrained"):  # every request wrote exactly its length on both sides
        assert result[side]["summary"]["num_output_tokens"] == result["free"]["summary"]["num_output_tokens"]
    assert result["free"]["summary"]["num_output_tokens"] >= plan.num_requests * plan.output_len_range[0]
    [(value, _)] = result["measured"].values()
    assert value > 0


def test_families_quick(bench_cache_dir: Path, tmp_path: Path) -> None:
    result = run_quick(bench_families, bench_cache_dir, tmp_path / "families.json")
    plan = bench_families.QUICK
    assert set(result["families"]) == {"qwen3", "qwen3_moe"}
    for family, runs in result["families"].items():
        assert runs["size"].startswith(f"{family}-")  # the family's own shape, not the Llama one
        for side in ("adapters", "base"):  # the same requests on both sides, every one finished at its length
            assert runs[side]["summary"]["num_completed"] == plan.num_requests
        value, _ = result["measured"][f"{family}_multi_vs_base"]
        throughputs = [runs[side]["summary"]["output_token_throughput"] for side in ("adapters", "base")]
        assert value == pytest.approx(throughputs[0] / throughputs[1])
    assert result["families"]["qwen3_moe"]["size"].endswith("-e8")  # 8 experts (adapters on each: bench_model)
    # the hybrid's decode step beside the dense one's, equal parameters within one MLP width step, every batch
    params = result["hybrid"]["parameters"]
    assert abs(params["hybrid"] - params["dense"]) < 0.05 * params["hybrid"]
    assert [row["batch"] for row in result["hybrid"]["rows"]] == list(bench_families.HYBRID_BATCHES)
    for row in result["hybrid"]["rows"]:
        value, _ = result["measured"][f"hybrid_decode_{row['batch']}"]
        assert value == pytest.approx(row["hybrid_median_ms"] / row["dense_median_ms"]) and value > 0
    kv = result["latent_kv"]  # DeepSeek-V3: per layer one head of kv_lora_rank + rope dims, against 128 heads' k and v
    assert (kv["layers"], kv["latent"], kv["plain"]) == (61, 61 * (512 + 64) * 2, 61 * 128 * (192 + 128) * 2)
    assert result["measured"]["latent_kv_bytes"][0] == pytest.approx(kv["latent"] / kv["plain"])
    assert set(result["measured"]) == set(bench_families.TARGETS)


def test_quantized_quick(bench_cache_dir: Path, tmp_path: Path) -> None:
    result = run_quick(bench_quantized, bench_cache_dir, tmp_path / "quantized.json")
    ours = cpu_gemv.chosen_for_int()  # the skinny-matrix kernels (AVX2, or AVX-512 BF16) take every INT format
    assert result["kernels"] == {"plain": [], "int8": [Avx2IntMatmul.name if ours else "int8 weight-only (torch CPU)"],
                                 "int4": [Avx2IntMatmul.name if ours else "int4 weight-only (torch CPU)"]}
    mib = result["linear_mib"]
    assert mib["int4"] < mib["int8"] < mib["plain"]  # resident bytes shrink with the bits
    assert result["batch"] == {"single": 1, "adapters": bench_quantized.QUICK.num_adapters}
    for batch in ("single", "adapters"):
        for label in ("int8", "int4"):
            value, _ = result["measured"][f"{label}_{batch}"]
            assert value == pytest.approx(result["step_ms"][batch]["plain"] / result["step_ms"][batch][label])


def test_decode_step_rows_of_the_adapter_forms(bench_cache_dir: Path, tmp_path: Path) -> None:
    # the in-process decode step at its smallest: 4 adapters, their DoRA copies, one adapter against a mix of 4
    out = tmp_path / "decode_step.json"
    bench_decode_step.main(["--size", "quick", "--paths", "torch", "--dtype", "float32", "--batch", "4", "--context",
                            "8", "--num-adapters", "4", "--steps", "1", "--cache-dir", str(bench_cache_dir),
                            "--json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    rows = result["results"]
    expected = {"4 adapters", "4 DoRA adapters", "1 adapter, every row (rank-64 pool)", "a mix of 4, every row"}
    assert expected <= set(rows)
    assert all(row["torch ops"]["median_ms"] > 0 for row in rows.values())
    assert set(result["ratios"]) == {"DoRA / plain LoRA, 4 adapters", "a mix of 4 / one adapter"}
    assert all(ratio["torch ops"] > 0 for ratio in result["ratios"].values())
    assert result["dora_load_s"] > 0


def test_roofline_tiny(bench_cache_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "roofline.json"
    bench_roofline.main(["--size", "quick", "--batches", "1,4", "--steps", "2", "--context", "16", "--array-mib", "32",
                         "--bandwidth-repeats", "2", "--cache-dir", str(bench_cache_dir), "--json", str(out)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["precision"], r["batch"]) for r in rows] == [(p, b) for p in ("bf16", "int8", "int4") for b in (1, 4)]
    keys = {"precision", "batch", "step_ms", "bytes_per_step", "bandwidth_gbs", "roofline_share"}
    for row in rows:
        assert set(row) == keys and row["step_ms"] > 0
        assert row["bandwidth_gbs"] == pytest.approx(row["bytes_per_step"] / row["step_ms"] * 1e-6)
        assert row["roofline_share"] == pytest.approx(row["bandwidth_gbs"] / result["read_bandwidth_gbs"])
    by = {(r["precision"], r["batch"]): r["bytes_per_step"] for r in rows}
    assert by[("int4", 1)] < by[("int8", 1)] < by[("bf16", 1)]  # fewer weight bytes with fewer bits
    assert by[("bf16", 4)] > by[("bf16", 1)]  # and more KV bytes with more requests
