"""Groups G7 (TP=2 at ModelRunner level, both ranks on one GPU) and G8 (compute-sanitizer over the small kernel
cases) of scripts/gpu_check/runner.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.gpu_check.lib import KEEP_PGID_ENV, REPO_ROOT, Context, max_abs, median
from tests.net import free_port

PROMPT_LENGTHS = [6, 11, 3, 17]
ADAPTERS = [None, "a16", "a64", "a32"]
DECODE_STEPS = 6
NCCL_INIT_TIMEOUT_S = 20
# Different host ids get past NCCL's "Duplicate GPU detected" check; loopback sockets carry the traffic.
NCCL_ONE_GPU_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo",
                    "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "WARN"}


def _config(tp: int, device: str, dtype: str):
    from loraplex.protocol.config import ServerConfig

    return ServerConfig(tp=tp, device=device, dtype=dtype, page_size=4, max_total_tokens=4096, enable_lora=True,
                        max_lora_rank=64, lora_target_modules=["all"], max_loras_per_batch=4,
                        lora_backend="auto" if device.startswith("cuda") else "torch")


def _workload(runner, adapters: dict[str, str]) -> dict:
    """Prefill logits of 4 prompts with adapters [None, a16, a64, a32], then greedy steps (as numpy: tensors would
    travel as shared-memory handles that die with the rank)."""
    from loraplex.protocol.structs import SlotLoad

    from scripts.gpu_check.model import _load_adapters, _prefill_and_step
    from tests.worker_helpers import GREEDY, decode, random_prompts

    ids = _load_adapters(runner, {name: Path(adapters[name]) for name in ADAPTERS if name})
    slots = [-1 if a is None else i - 1 for i, a in enumerate(ADAPTERS)]
    ids_by_slot = {s: ids[a] for s, a in zip(slots, ADAPTERS, strict=True) if a}
    prompts = random_prompts(PROMPT_LENGTHS, runner.vocab_size, seed=3)
    per_req, _, _ = _prefill_and_step(runner, prompts, slots, ids_by_slot)
    loads = [SlotLoad(slot=s, lora_id=i) for s, i in ids_by_slot.items()]
    greedy = decode(runner, prompts, [GREEDY] * len(prompts), DECODE_STEPS, slots=slots, slot_loads=loads)
    return {"logits": [x.numpy() for x in per_req], "greedy": greedy, "max_total_tokens": runner.max_total_tokens}


def tp_rank(rank: int, port: int, backend: str, device_type: str, model_dir: str, adapters: dict[str, str],
            results: mp.Queue) -> None:
    """One TP rank (spawned): join the group, then run the workload in fp32 and bf16."""
    import torch
    import torch.distributed as dist
    from loraplex.worker.dist import destroy_distributed, init_distributed
    from loraplex.worker.model_runner import ModelRunner

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cpu":
        torch.set_num_threads(1)
    start = time.perf_counter()
    if backend == "gloo" and device_type == "cuda":  # the fallback: gloo all-reduces CUDA tensors via the host
        torch.cuda.set_device(device)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    else:
        init_distributed(_config(2, device_type, "float32"), f"127.0.0.1:{port}", rank, device)
    results.put((rank, "ready", time.perf_counter() - start))
    try:
        out = {}
        for dtype in ("float32", "bfloat16"):
            runner = ModelRunner(_config(2, device_type, dtype), model_dir, rank, 2, device)
            out[dtype] = _workload(runner, adapters)
            del runner
        x = torch.ones(2048, dtype=torch.bfloat16, device=device)
        for _ in range(3):
            dist.all_reduce(x)
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if device_type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        out["all_reduce_ms"] = median(times)
        results.put((rank, "done", out))
    finally:
        destroy_distributed()


def tp_graph_rank(rank: int, port: int, backend: str, device_type: str, model_dir: str, adapters: dict[str, str],
                  results: mp.Queue) -> None:
    """One TP rank on its own GPU (cuda:rank) with --enable-cuda-graph: the decode graphs are captured on every rank
    with the all-reduces inside them. Greedy decoding through the graphs against the same static buffers run
    eagerly (same kernels, shapes and split count): tokens equal, logits within 1e-2 (bf16)."""
    import msgspec
    import torch
    from loraplex.protocol.structs import SlotLoad
    from loraplex.worker.dist import destroy_distributed, init_distributed
    from loraplex.worker.model_runner import ModelRunner

    from scripts.gpu_check.model import _load_adapters
    from tests.worker_helpers import GREEDY, decode, random_prompts

    device = torch.device("cuda", rank)
    config = msgspec.structs.replace(_config(2, "cuda", "bfloat16"), enable_cuda_graph=True,
                                     attention_backend="triton", max_running_requests=8)
    init_distributed(config, f"127.0.0.1:{port}", rank, device)
    results.put((rank, "ready", 0.0))
    try:
        start = time.perf_counter()
        runner = ModelRunner(config, model_dir, rank, 2, device)
        capture_s = time.perf_counter() - start
        ids = _load_adapters(runner, {name: Path(adapters[name]) for name in ADAPTERS if name})
        slots = [-1 if a is None else i - 1 for i, a in enumerate(ADAPTERS)]
        loads = [SlotLoad(slot=s, lora_id=ids[a]) for s, a in zip(slots, ADAPTERS, strict=True) if a]
        prompts = random_prompts(PROMPT_LENGTHS, runner.vocab_size, seed=3)
        graphed = decode(runner, prompts, [GREEDY] * len(prompts), DECODE_STEPS, slots=slots, slot_loads=loads)
        runner.decode_graphs = runner.graph_runner(capture=False)
        eager = decode(runner, prompts, [GREEDY] * len(prompts), DECODE_STEPS, slots=slots, slot_loads=loads)
        results.put((rank, "done", {"graphed": graphed, "eager": eager, "capture_s": capture_s}))
    finally:
        destroy_distributed()


def _run_ranks(backend: str, device_type: str, model_dir: str, adapters: dict[str, str], deadline: float,
               target=None):
    """Both ranks; None if they did not report ready within NCCL_INIT_TIMEOUT_S (the caller falls back)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = []
    for rank in (0, 1):
        env_backup = dict(os.environ)
        if backend == "nccl" and target is None:  # two ranks on one GPU
            os.environ.update(NCCL_ONE_GPU_ENV, NCCL_HOSTID=f"loraplex-r{rank}")
        procs.append(ctx.Process(target=target or tp_rank, args=(rank, port, backend, device_type, model_dir, adapters,
                                                       results), daemon=True))
        procs[-1].start()  # a spawned child takes os.environ as it is at start
        os.environ.clear()
        os.environ.update(env_backup)
    ready, done = {}, {}
    # NCCL gets NCCL_INIT_TIMEOUT_S (+ the ranks' torch import) before the caller falls back to gloo
    init_deadline = time.monotonic() + NCCL_INIT_TIMEOUT_S + 5 if backend == "nccl" else deadline
    try:
        while len(done) < 2:
            now = time.monotonic()
            if len(ready) < 2 and now > init_deadline:
                return None
            if now > deadline:
                raise TimeoutError(f"TP ranks gave no result (ready: {sorted(ready)}, done: {sorted(done)})")
            crashed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if crashed:
                raise RuntimeError(f"a TP rank exited with {crashed}")
            try:
                rank, kind, payload = results.get(timeout=0.5)
            except queue.Empty:
                continue
            (ready if kind == "ready" else done)[rank] = payload
        return done
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def g7_tp2(ctx: Context) -> None:
    import torch
    from loraplex.worker.model_runner import ModelRunner

    from scripts.gpu_check.model import _build_adapters
    from tests.builders import build_tiny_model

    rec = ctx.rec
    root = Path(tempfile.mkdtemp(prefix="gpu_check_g7_"))
    model_dir = root / "medium"
    if ctx.is_cuda:
        build_tiny_model(model_dir, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2,
                         intermediate_size=1376, max_position_embeddings=2048)
    else:
        build_tiny_model(model_dir)
    adapters = {k: str(v) for k, v in _build_adapters(model_dir, root / "adapters").items()}
    device_type = ctx.device.type
    deadline = time.monotonic() + (35 if ctx.is_cuda else 80)
    by_rank, backend_used = None, "gloo-cpu"
    if ctx.is_cuda:
        by_rank = _run_ranks("nccl", "cuda", str(model_dir), adapters, deadline)
        backend_used = "nccl-hostid"
        if by_rank is None:
            rec.figure("nccl_init", f"not ready in {NCCL_INIT_TIMEOUT_S} s; fell back to gloo")
            by_rank = _run_ranks("gloo", "cuda", str(model_dir), adapters, time.monotonic() + 30)
            backend_used = "gloo"
    else:
        by_rank = _run_ranks("gloo", "cpu", str(model_dir), adapters, deadline)
    rec.figure("backend_used", backend_used if by_rank else "none")
    if by_rank is None:
        rec.check("tp2_ran", False, "no ranks ready", "both ranks join")
        return
    tp1 = {dtype: _workload(ModelRunner(_config(1, device_type, dtype), str(model_dir), 0, 1, ctx.device), adapters)
           for dtype in ("float32", "bfloat16")}
    fp32_diff = max(max_abs(torch.from_numpy(a), torch.from_numpy(b)) for rank in (0, 1)
                    for a, b in zip(by_rank[rank]["float32"]["logits"], tp1["float32"]["logits"], strict=True))
    tokens_equal = all(by_rank[rank]["float32"]["greedy"] == tp1["float32"]["greedy"] for rank in (0, 1))
    rec.check("fp32_logits", fp32_diff <= 1e-3, fp32_diff, 1e-3, f"TP2 ({backend_used}) vs TP1, both ranks")
    rec.check("fp32_greedy_tokens", tokens_equal, tokens_equal, True, f"{DECODE_STEPS} greedy steps, 4 prompts")

    def err(logits_a, logits_b) -> float:
        return max(max_abs(torch.from_numpy(a).float(), torch.from_numpy(b).float())
                   for a, b in zip(logits_a, logits_b, strict=True))

    e_tp2 = max(err(by_rank[rank]["bfloat16"]["logits"], tp1["float32"]["logits"]) for rank in (0, 1))
    e_tp1 = err(tp1["bfloat16"]["logits"], tp1["float32"]["logits"])
    calibrated = e_tp2 <= 1.5 * e_tp1 + 0.02
    rec.check("bf16_calibrated", calibrated, {"tp2": e_tp2, "tp1": e_tp1}, "tp2 <= 1.5 tp1 + 0.02",
              "errors against TP1 fp32")
    totals = [by_rank[rank][dtype]["max_total_tokens"] for rank in (0, 1) for dtype in ("float32", "bfloat16")]
    rec.check("max_total_tokens_agreed", len(set(totals)) == 1, totals, "equal on both ranks")
    rec.figure("fp32_max_diff", fp32_diff)
    rec.figure("tokens_equal", tokens_equal)
    rec.figure("bf16_calibrated", "pass" if calibrated else "fail")
    rec.figure("all_reduce_ms_2048_bf16", by_rank[0]["all_reduce_ms"])
    _tp2_graphs(ctx, str(model_dir), adapters)


def _tp2_graphs(ctx: Context, model_dir: str, adapters: dict[str, str]) -> None:
    """TP=2 with --enable-cuda-graph, one rank per GPU (gloo cannot be captured, and two ranks on one GPU would
    capture NCCL over loopback sockets: not what a server runs)."""
    import torch

    if not ctx.skip_unless_cuda("tp2_cuda_graphs"):
        return
    if torch.cuda.device_count() < 2:
        ctx.rec.skip("tp2_cuda_graphs", f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
        return
    by_rank = _run_ranks("nccl", "cuda", model_dir, adapters, time.monotonic() + 60, target=tp_graph_rank)
    if by_rank is None:
        ctx.rec.check("tp2_cuda_graphs", False, "no ranks ready", "both ranks join")
        return
    equal = all(by_rank[r]["graphed"] == by_rank[r]["eager"] for r in (0, 1))
    equal = equal and by_rank[0]["graphed"] == by_rank[1]["graphed"]
    ctx.rec.check("tp2_cuda_graphs", equal, {r: by_rank[r]["graphed"][0] for r in (0, 1)},
                  "graph == eager, ranks agree",
                  f"{DECODE_STEPS} greedy steps replayed from graphs with the all-reduce inside, bf16")
    ctx.rec.figure("tp2_graph_capture_s", max(by_rank[r]["capture_s"] for r in (0, 1)))


# ---- G8: compute-sanitizer ---------------------------------------------------------------------------------------


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for candidate in ("/usr/local/cuda/bin/compute-sanitizer", "/opt/nvidia/compute-sanitizer/compute-sanitizer"):
        if os.path.exists(candidate):
            return candidate
    return None


def g8_sanitizer(ctx: Context) -> None:
    if not ctx.is_cuda:
        ctx.rec.skip("memcheck", "dry-run: needs CUDA")
        ctx.rec.figure("result", "skipped: dry-run")
        return
    tool = _sanitizer()
    if tool is None:
        ctx.rec.skip("memcheck", "compute-sanitizer not found")
        ctx.rec.figure("result", "skipped: compute-sanitizer not found")
        return
    out_dir = tempfile.mkdtemp(prefix="gpu_check_sanitizer_", dir=ctx.scratch)
    limit_s = max(10.0, ctx.cap_s - 15)  # leave time to record the result before the parent's kill
    cmd = [tool, "--tool", "memcheck", "--print-limit", "20", sys.executable, "-m", "scripts.gpu_check",
           "--only", "kernels_small", "--out", out_dir, "--cap-scale", "10", "--budget-s", str(limit_s)]
    # A session of its own, registered, with every process of the nested run in it (KEEP_PGID_ENV): one kill
    # here at the limit, or the parent's at the cap, ends all of them.
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=dict(os.environ, **{KEEP_PGID_ENV: "1"}))
    ctx.own_process_group(proc.pid)
    try:
        text, _ = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        ctx.rec.skip("memcheck", f"compute-sanitizer did not finish within {limit_s:.0f} s (--sanitizer-s)")
        ctx.rec.figure("result", "skipped: timeout")
        return
    match = re.search(r"ERROR SUMMARY: (\d+) error", text)
    if match is None:
        ctx.rec.skip("memcheck", f"no ERROR SUMMARY (the tool may refuse this device): {text[-300:]}")
        ctx.rec.figure("result", "skipped: tool refused or no summary")
        return
    errors = int(match.group(1))
    ctx.rec.check("memcheck", errors == 0, errors, 0, "K5, K6, K9 in bf16 under memcheck")
    ctx.rec.figure("result", f"{errors} errors")
    if errors:
        ctx.rec.figure("sanitizer_tail", text[-4000:])
