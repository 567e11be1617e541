"""The summary of gpu_check.json and the reviewer block printed last (GPU_CHECK.md: "The report", "What a
reviewer reads"). Plain Python: the parent process that uses it never imports torch."""

from __future__ import annotations

from typing import Any


def summarize(groups: dict[str, dict]) -> dict:
    counts = {"pass": 0, "fail": 0, "error": 0, "skipped": 0}
    first_failure, perf_flags = None, []
    for gid, group in groups.items():
        if group["status"] in ("error", "timeout"):
            counts["error"] += 1
            first_failure = first_failure or f"{gid}: {group['status']} ({group.get('reason')})"
        elif group["status"] == "skipped" and not group["checks"]:
            counts["skipped"] += 1
        for c in group["checks"]:
            if c["kind"] == "skip":
                counts["skipped"] += 1
            elif c["kind"] == "flag":
                if c["pass"] is False:
                    perf_flags.append(c["name"])
            elif c["pass"]:
                counts["pass"] += 1
            else:
                counts["fail"] += 1
                if first_failure is None:
                    first_failure = f"{gid}.{c['name']} {_fmt(c['value'])}>{_fmt(c['threshold'])}"
    attention = groups.get("g2", {}).get("figures", {}).get("backend", {})
    tp2 = groups.get("g7", {}).get("figures", {}).get("backend_used")
    return {**counts, "first_failure": first_failure, "perf_flags": perf_flags,
            "attention_backend": {"decode": attention.get("decode", "n/a"), "prefill": attention.get("prefill", "n/a")},
            "tp2_backend": tp2 or "none"}


def _fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return format(value, spec)
    if isinstance(value, dict):
        return "/".join(_fmt(v, spec) for v in value.values())
    return str(value)


def _fig(report: dict, gid: str, *keys: str) -> Any:
    value: Any = report["groups"].get(gid, {}).get("figures", {})
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _status(report: dict, gid: str) -> str | None:
    group = report["groups"].get(gid)
    if group is None:
        return "not run"
    if group["status"] in ("skipped", "error", "timeout"):
        return f"{group['status']}: {group.get('reason')}"
    return None


def _decode_rows(report: dict) -> list[str]:
    table = _fig(report, "g4", "decode")
    if not table:
        return [f"  {_status(report, 'g4') or 'no decode figures'}"]
    rows = []
    for batch, by_adapters in table.items():
        cells = []
        for adapters, cell in by_adapters.items():
            cells.append(f"{adapters} {_fmt(cell.get('wall_ms_p50'), '.2f')} ms | {_fmt(cell.get('tok_s'), '.0f')} | "
                         f"{_fmt(cell.get('busy_pct'), '.0f')}% | {_fmt(cell.get('kernels_per_step'))} | "
                         f"x{_fmt(cell.get('x_roofline'), '.1f')}")
        rows.append(f"  {batch:<6}" + "  ;  ".join(cells))
    return rows


def _graph_row(report: dict) -> str:
    """The decode matrix replayed from CUDA graphs: ms p50 and the speedup over eager, per batch and adapters."""
    table = _fig(report, "g4", "decode_cuda_graph")
    if not table:
        return "  CUDA graphs: not measured"
    cells = [
        f"{batch} {adapters} {_fmt(cell.get('wall_ms_p50'), '.2f')} ms x{_fmt(cell.get('speedup_vs_eager'), '.1f')} "
        f"{_fmt(cell.get('launches'))}/{_fmt(cell.get('eager_launches'))} k "
        f"x{_fmt(cell.get('x_weight_roofline'), '.1f')}w"
        for batch, by_adapters in table.items()
        for adapters, cell in by_adapters.items()
    ]
    return ("  CUDA graphs (ms p50, speedup over eager, kernels graph/eager, x weight roofline): "
            + "; ".join(cells))


def _triton_decode_us(attention: dict) -> float | None:
    return (attention.get("decode_timing") or {}).get("B128_ctx2048", {}).get("triton_us")


def _latent_decode_us(attention: dict) -> float | None:
    return (attention.get("latent_decode_timing") or {}).get("h16_B32_ctx8192", {}).get("us")


def _sdpa_decode_us(attention: dict) -> float | None:
    return (attention.get("decode_timing") or {}).get("B128_ctx2048", {}).get("us")


def reviewer_block(report: dict) -> str:
    meta, summary = report["meta"], report["summary"]
    versions, device, ceilings = meta.get("versions", {}), meta.get("device", {}), meta.get("ceilings", {})
    gpu = device.get("name", "cpu (dry run)" if meta.get("dry_run") else "n/a")
    kernels_worst = _fig(report, "g1", "worst_rel_err") or {}
    attention = _fig(report, "g2") or {}
    numerics = _fig(report, "g3") or {}
    prefill = _fig(report, "g4", "prefill") or {}
    dynamic = _fig(report, "g4", "dynamic") or {}
    server = _fig(report, "g5") or {}
    perf = _fig(report, "g6", "headline") or {}
    tp2 = _fig(report, "g7") or {}
    copy = ceilings.get("copy_GBps")
    lines = [
        f"=== loraplex GPU check: {gpu}, torch {versions.get('torch', 'n/a')}, triton {versions.get('triton', 'n/a')}, "
        f"cuDNN {versions.get('cudnn', 'n/a')}, NCCL {versions.get('nccl', 'n/a')}; {meta['wall_s']:.0f} s of "
        f"{meta['budget_s']:.0f} ===",
        f"VERSIONS: python {versions.get('python', 'n/a')}, CUDA {versions.get('torch_cuda', 'n/a')}, driver "
        f"{device.get('driver', 'n/a')}, xgrammar {versions.get('xgrammar', 'n/a')}; Triton cache entries before/after "
        f"{_fmt(meta.get('triton_cache'))}",
        f"RESULT: {summary['pass']} pass, {summary['fail']} FAIL, {summary['error']} error, {summary['skipped']} "
        f"skipped; first failure: {summary['first_failure'] or 'none'}",
        f"CEILINGS: copy {_fmt(copy / 1e3 if copy else None)} TB/s, bf16 GEMM "
        f"{_fmt(ceilings.get('bf16_gemm_TFLOPs'))} TFLOP/s, pinned H2D {_fmt(ceilings.get('h2d_pinned_GBps'))} GB/s",
        f"KERNELS: worst bf16 rel err {_fmt(kernels_worst.get('err'))} (<=8e-3) at {kernels_worst.get('case', 'n/a')}; "
        f"compile variants {_fmt(_fig(report, 'g1', 'compiled_variants'))}, worst first-call "
        f"{_fmt(_fig(report, 'g1', 'worst_first_call_ms'))} ms; {_gated_delta(report)}" + _suffix(report, "g1"),
        f"ATTENTION: backend decode={summary['attention_backend']['decode']} "
        f"prefill={summary['attention_backend']['prefill']}; max err {_fmt(attention.get('max_err'))} (<=2e-2); "
        f"backends accepting: {_fmt(attention.get('backends_accepting'))}; 8k prefill mem "
        f"{_fmt(attention.get('prefill_8k_mem_GiB'))} GiB; triton paged: max err "
        f"{_fmt(attention.get('triton_max_err'))}, decode B128 ctx2048 {_fmt(_triton_decode_us(attention))} us vs SDPA "
        f"{_fmt(_sdpa_decode_us(attention))} us; latent (DeepSeek-V3 512+64): max err "
        f"{_fmt(attention.get('latent_max_err'))}, decode 16 heads B32 ctx8192 {_fmt(_latent_decode_us(attention))} us"
        + _suffix(report, "g2"),
        f"NUMERICS: fp32 vs HF {_fmt(numerics.get('fp32_vs_hf'))} (<=2e-4); bf16 ours/HF err "
        f"{_fmt(numerics.get('bf16_ours'))}/{_fmt(numerics.get('bf16_hf'))}; LoRA mixed vs peft fp32 "
        f"{_fmt(numerics.get('lora_mixed_fp32'))}; greedy steps matched {_fmt(numerics.get('greedy_matched'))}/"
        f"{_fmt(numerics.get('greedy_total'))}" + _suffix(report, "g3"),
        "DECODE 1B bf16 ctx512 (ms p50 | tok/s | busy% | kernels/step | x roofline):",
        *_decode_rows(report),
        _graph_row(report),
        f"PREFILL: 2048 tok {_fmt(prefill.get('ms_2048'))} ms ({_fmt(prefill.get('pct_gemm_roofline'))}% of GEMM "
        f"roofline); 128x512 {_fmt(prefill.get('tok_s_128x512'), '.0f')} tok/s",
        f"KERNELS (8B shapes): shrink {_fmt(perf.get('shrink_GBps'))} GB/s ({_fmt(perf.get('shrink_pct'))}% copy), "
        f"expand {_fmt(perf.get('expand_GBps'))} GB/s ({_fmt(perf.get('expand_pct'))}%), 1-token down r64 "
        f"{_fmt(perf.get('down_1tok_r64_us'))} us (split-K off {_fmt(perf.get('down_1tok_r64_no_split_us'))}), "
        f"host enqueue {_fmt(perf.get('enqueue_us'))} us/call"
        + _suffix(report, "g6"),
        _quantized_row(report),
        f"DYNAMIC LORA: bitwise-unchanged {_yes(dynamic.get('bitwise_unchanged'))}; read p50 "
        f"{_fmt(dynamic.get('read_ms_p50'))} ms, slot load r16/r64 {_fmt(dynamic.get('load_slot_ms_r16'))}/"
        f"{_fmt(dynamic.get('load_slot_ms_r64'))} ms, p99 churn/quiet {_fmt(dynamic.get('p99_ratio'))}; GPU leak "
        f"{_fmt(dynamic.get('leak_bytes'))} B" + _suffix(report, "g4"),
        f"SERVER: out tok/s base/8/32 = {_fmt(server.get('out_tok_s'), '.0f')} (ratios {_fmt(server.get('ratios'))}); "
        f"TTFT p50/p99 {_fmt(server.get('ttft_ms'), '.0f')} ms; ITL p50/p99 {_fmt(server.get('itl_ms'), '.1f')} ms; "
        f"load p50 idle/busy {_fmt(server.get('load_ms'), '.0f')} ms; storm/quiet {_fmt(server.get('storm_quiet'))}"
        + _suffix(report, "g5"),
        f"SERVER GRAPHS: tokens equal eager {_check(report, 'g5b', 'graph_tokens_equal_eager')}; ITL graph/eager "
        f"{_fmt(_fig(report, 'g5b', 'itl_ratio_graph_over_eager'))}; structured output "
        f"{_check(report, 'g5b', 'structured_output')} in {_fmt(_fig(report, 'g5b', 'structured_ms'), '.0f')} ms"
        + _suffix(report, "g5b"),
        f"TP2 one GPU ({tp2.get('backend_used', 'none')}): fp32 max diff {_fmt(tp2.get('fp32_max_diff'))} (<=1e-3), "
        f"tokens equal {_yes(tp2.get('tokens_equal'))}; bf16 calibrated {_fmt(tp2.get('bf16_calibrated'))}"
        + _suffix(report, "g7"),
        f"SANITIZER: {_fig(report, 'g8', 'result') or _status(report, 'g8') or 'n/a'}",
        f"PERF FLAGS: {', '.join(summary['perf_flags']) or 'none'}",
    ]
    return "\n".join(lines)


def _gated_delta(report: dict) -> str:
    worst, us = _fig(report, "g1", "gated_delta_worst_rel_err") or {}, _fig(report, "g1", "gated_delta_us") or {}
    return (f"gated delta err {_fmt(worst.get('err'))} at {worst.get('case', 'n/a')}, triton/torch us decode32 "
            f"{_fmt(us.get('decode32.triton_us'))}/{_fmt(us.get('decode32.torch_us'))} prefill4x512 "
            f"{_fmt(us.get('prefill4x512.triton_us'))}/{_fmt(us.get('prefill4x512.torch_us'))}")  # fmt: skip


def _quantized_row(report: dict) -> str:
    """G9: each quantized path's µs on the 8B down projection at batch 1 beside the plain matmul's, the worst errors
    and the kernel choice on this device."""
    headline = _fig(report, "g9", "headline") or {}
    paths = ", ".join(f"{path} {_fmt(us, '.1f')}" for path, us in (headline.get("down_B1_us") or {}).items())
    worst = headline.get("worst_err") or {}
    return (f"QUANTIZED (8B down, B=1, us): {paths or 'n/a'} vs bf16 {_fmt(headline.get('down_B1_plain_us'), '.1f')}; "
            f"worst err triton {_fmt(worst.get('triton'))} (<=8e-3), scaled_mm {_fmt(worst.get('scaled_mm'))} "
            f"(<=8e-3 vs emulated); kernel choice {_check(report, 'g9', 'kernel_choice')}; MoE grouped plain/mxfp4 "
            f"{_check(report, 'g9', 'moe_grouped.plain')}/{_check(report, 'g9', 'moe_grouped.mxfp4')}, device-routed "
            f"step graph {_check(report, 'g9', 'moe_cuda_graph')}" + _suffix(report, "g9"))


def _check(report: dict, gid: str, name: str) -> str:
    checks = report["groups"].get(gid, {}).get("checks", [])
    found = next((c for c in checks if c["name"] == name), None)
    if found is None:
        return "n/a"
    return "skipped" if found["kind"] == "skip" else "pass" if found["pass"] else "FAIL"


def _yes(value: Any) -> str:
    return "n/a" if value is None else "yes" if value else "no"


def _suffix(report: dict, gid: str) -> str:
    status = _status(report, gid)
    return f"  [{status}]" if status else ""
