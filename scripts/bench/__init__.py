"""Benchmarks. Ratio benchmarks: `python -m scripts.bench NAME` (ratios.py, the table); the others:
`python -m scripts.bench.NAME`. `python -m scripts.bench` lists both.

    ratios.py      the ratio benchmarks' table and command line; one module each measures:
                   prefix_cache, chunked_prefill, kv_admission, structured, dp, families, quantized, fairness,
                   step_overhead, speculative (with --llama-cpp DIR, llama-server's sides: spec_llama_cpp.py)
    all.py         every benchmark on one workload, one table of every ratio
    model.py       the bench model and its adapters (built once, cached)
    workload.py    the seeded request list;  report.py  summaries, tables, JSON;  server.py  the bench server's flags
"""

from __future__ import annotations

# name -> what it does: the benchmarks and tools with a command line of their own (python -m scripts.bench.NAME)
TOOLS: dict[str, str] = {
    "all": "every benchmark on one workload and one table of every ratio (the README's figures)",
    "serving": "load generator against a running server: throughput, TTFT, ITL per adapter",
    "adapter_ops": "adapter load/unload cost on a running server, idle and under traffic",
    "peft_baseline": "the same workload through transformers + peft",
    "llama_cpp": "loraplex beside llama.cpp's server on the bench model at bf16, 8 and 4 bits",
    "vllm_cpu": "loraplex beside vLLM's CPU build on the bench model: base only, 32 adapters, one stream",
    "decode_step": "one worker's decode step in process, cpu backend against torch",
    "roofline": "the decode step per precision and batch against this machine's measured read bandwidth",
    "gemv": "per-linear timings, the CPU linears' kernels against torch's paths at bf16/int8/int4, 1 and 32 rows",
    "hybrid_decode": "a hybrid (Gated DeltaNet) model's decode step beside a dense one of equal parameters",
    "sampling_options": "what sampling options cost a decode step, in process",
    "tp_allreduce": "row-parallel LoRA under TP=2: the LoRA term in the layer's all-reduce against its own",
    "spec_acceptance": "draft adapters' acceptance per adapter on the trained demo (a cut demo as the draft model)",
    "model": "build (or find) the bench model and print its paths",
    "soak": "a server with fairness, limits and priorities under mixed traffic for a while",
    "vision": "image requests: TTFT and throughput (32 at once, mixed adapters), prefix cache on and off, image cost",
}
