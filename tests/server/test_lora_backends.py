"""--lora-backend: each backend selectable and equal to the torch reference (kernel ops and a tiny model), the start-up
failure of a choice the device cannot run (in process and at server level), and the Triton warm-up."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from loraplex.frontend.entrypoints.cli import config_from_args
from loraplex.kernels import BackendError, cpu_ext, select_backend
from loraplex.kernels.backend import CPUKernelsBackend, TorchBackend, TritonBackend, warmup_batches
from loraplex.kernels.segment_tiles import plan_tiles
from loraplex.protocol.config import ServerConfig
from loraplex.worker.model_runner import ModelRunner

from tests.compute.test_kernels import CASES, TOLERANCES, dense_expand, dense_shrink, dense_shrink_expand, make_batch
from tests.device_helpers import TEST_DEVICE, USES_GPU
from tests.lora_helpers import LORA_CONFIG, MIXED, batch_logits, load_all
from tests.server_utils import LAUNCH, free_port
from tests.worker_helpers import NUM_PAGES, PAGE_SIZE, random_prompts

CPU_KERNELS_OFF = cpu_ext.unavailable_reason()
needs_cpu_kernels = pytest.mark.skipif(
    USES_GPU or CPU_KERNELS_OFF is not None, reason=f"the CPU kernels cannot run here: {CPU_KERNELS_OFF or 'GPU'}"
)
# backend -> the dtype it is checked in (the CPU kernels are bfloat16 only; the interpreter's bf16 dot is wrong)
BACKEND_DTYPES = {"torch": torch.float32, "triton": torch.float32, "cpu": torch.bfloat16}
BACKEND_PARAMS = [pytest.param("torch"), pytest.param("triton"), pytest.param("cpu", marks=needs_cpu_kernels)]


# ---- selection --------------------------------------------------------------------------------------------------


def test_flag_parses_and_defaults_to_auto() -> None:
    assert ServerConfig().lora_backend == "auto"
    assert config_from_args(["--lora-backend", "torch"]).lora_backend == "torch"
    with pytest.raises(SystemExit):
        config_from_args(["--lora-backend", "cuda"])


def test_auto_picks_by_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    assert type(select_backend("auto", "cpu", torch.float32)) is TorchBackend
    if CPU_KERNELS_OFF is None:
        assert type(select_backend("auto", "cpu", torch.bfloat16)) is CPUKernelsBackend
    monkeypatch.setattr(cpu_ext, "kernels", lambda: None)  # a failed build: torch ops, no error
    assert type(select_backend("auto", "cpu", torch.bfloat16)) is TorchBackend
    assert type(select_backend("auto", "cuda", torch.bfloat16)) is TritonBackend  # chosen, nothing launched
    assert select_backend("auto", "cuda", torch.bfloat16).cpu_kernels is None


IMPOSSIBLE = {  # name -> (choice, device, dtype, environment/monkeypatch, what the line says)
    "triton_on_cpu": ("triton", "cpu", torch.float32, "no_interpreter", "needs a CUDA device; this worker runs"),
    "cpu_on_cuda": ("cpu", "cuda:0", torch.bfloat16, None, "bfloat16 on the CPU; this worker runs bfloat16 on cuda:0"),
    "cpu_in_fp32": ("cpu", "cpu", torch.float32, None, "only bfloat16 on the CPU; this worker runs float32 on cpu"),
    "cpu_unsupported": ("cpu", "cpu", torch.bfloat16, "no_avx512", "cannot run here: the CPU lacks avx512_bf16"),
    "cpu_build_fails": ("cpu", "cpu", torch.bfloat16, "build_fails", "failed to build"),
}


@pytest.mark.parametrize("case", list(IMPOSSIBLE))
def test_impossible_choice_is_one_line(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    choice, device, dtype, setup, message = IMPOSSIBLE[case]
    if setup == "no_interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    elif setup == "no_avx512":
        monkeypatch.setattr(cpu_ext, "unavailable_reason", lambda: "the CPU lacks avx512_bf16")
    elif setup == "build_fails":
        monkeypatch.setattr(cpu_ext, "unavailable_reason", lambda: None)
        monkeypatch.setattr(cpu_ext, "kernels", lambda: None)
    with pytest.raises(BackendError) as info:
        select_backend(choice, device, dtype)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert str(info.value).startswith(f"--lora-backend {choice}")


def test_runner_fails_before_loading_weights(llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("loraplex.worker.model_runner.load_weights", lambda *a: pytest.fail("weights loaded"))
    config = ServerConfig(device="cpu", dtype="float32", lora_backend="cpu", **LORA_CONFIG)
    with pytest.raises(BackendError, match="--lora-backend cpu runs only bfloat16"):
        ModelRunner(config, str(llama_dir), rank=0, world_size=1, device="cpu")


@pytest.mark.parametrize(
    "argv, env",
    [(["--lora-backend", "cpu", "--dtype", "float32"], {}), (["--lora-backend", "triton"], {"TRITON_INTERPRET": "0"})],
    ids=["cpu_in_fp32", "triton_on_cpu"],
)
def test_server_exits_nonzero_with_one_line(argv: list[str], env: dict[str, str], llama_dir: Path) -> None:
    cmd = [*LAUNCH, "--device", "cpu", "--model-path", str(llama_dir),
           "--port", str(free_port()), "--log-level", "error", *argv]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**_env(), **env})
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("loraplex: error:")]
    assert len(errors) == 1 and f"--lora-backend {argv[1]}" in errors[0], proc.stderr


def _env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1")


# ---- the ops, against the float64 reference ----------------------------------------------------------------------


def _weights(b, device: torch.device) -> SimpleNamespace:
    return SimpleNamespace(
        lora_a=b.lora_a.to(device), lora_b=b.lora_b.to(device), slice_offsets=b.slice_offsets.to(device),
        row_offsets=tuple(b.slice_offsets.tolist()), slot_ranks=b.slot_ranks.to(device),
        slot_scales=b.slot_scales.to(device), host_ranks=b.slot_ranks.tolist(), host_scales=b.slot_scales.tolist(),
        num_slices=b.num_slices,
    )  # fmt: skip


def _backend(name: str) -> object:
    device = "cpu" if name == "cpu" else TEST_DEVICE
    return select_backend(name, device, BACKEND_DTYPES[name])


@pytest.mark.parametrize("backend_name", BACKEND_PARAMS)
@pytest.mark.parametrize("num_slices", [1, 3])
@pytest.mark.parametrize("case_name", ["mixed", "decode_sorted", "prefill_and_decodes", "long", "all_base"])
def test_backend_ops_match_reference(backend_name: str, num_slices: int, case_name: str) -> None:
    backend = _backend(backend_name)
    dtype = BACKEND_DTYPES[backend_name]
    tol = TOLERANCES.get(dtype, dict(atol=3e-2, rtol=2e-2))
    b = make_batch(CASES[case_name], num_slices, dtype)
    device = backend.device
    w = _weights(b, device)
    seg_indptr = b.seg_indptr.tolist()
    meta = backend.prepare(seg_indptr, b.seg_slots.tolist())
    assert meta.seg_indptr.tolist() == seg_indptr and meta.seg_slots.tolist() == b.seg_slots.tolist()
    assert meta.seg_indptr.device.type == meta.seg_slots.device.type == device.type
    h = backend.shrink(b.x.to(device), w, meta)
    torch.testing.assert_close(h.cpu().double(), dense_shrink(b), **tol)
    y = b.y.clone().to(device)
    backend.expand(y, b.h.to(device), w, meta)
    torch.testing.assert_close(y.cpu().double(), dense_expand(b), **tol)
    y = b.y.clone().to(device)
    backend.shrink_expand(y, b.x.to(device), w, meta)
    torch.testing.assert_close(y.cpu().double(), dense_shrink_expand(b), **tol)


# ---- a tiny model through each backend ---------------------------------------------------------------------------


def _runner(model_dir: Path, backend: str, dtype: torch.dtype, device: torch.device) -> ModelRunner:
    config = ServerConfig(device=device.type, dtype=str(dtype).removeprefix("torch."), lora_backend=backend,
                          page_size=PAGE_SIZE, max_total_tokens=NUM_PAGES * PAGE_SIZE, **LORA_CONFIG)  # fmt: skip
    return ModelRunner(config, str(model_dir), rank=0, world_size=1, device=device)


def _mixed_logits(runner: ModelRunner, adapter_dirs: dict[str, Path]) -> torch.Tensor:
    load_all(runner, adapter_dirs)
    names = [*MIXED, "a16"]  # and a prefill segment longer than the torch path's short segments
    prompts = random_prompts([5, 9, 3, 12, 7, 4, 10, 6, 8, 20], runner.vocab_size, seed=31)
    return torch.cat(batch_logits(runner, prompts, names)).float().cpu()


@pytest.mark.parametrize("backend_name", BACKEND_PARAMS)
def test_tiny_model_matches_torch_backend(
    backend_name: str, llama_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    device = torch.device("cpu") if backend_name == "cpu" else TEST_DEVICE
    runner = _runner(llama_dir, backend_name, BACKEND_DTYPES[backend_name], device)
    assert runner.backend.name == backend_name and runner.lora.backend is runner.backend
    ours = _mixed_logits(runner, adapter_dirs)
    reference = _mixed_logits(_runner(llama_dir, "torch", torch.float32, device), adapter_dirs)
    if backend_name != "cpu":
        assert (ours - reference).abs().max().item() <= 1e-4
        return
    # bfloat16: as close to float32 as the torch ops in bfloat16 are
    assert runner.model.model.norm.ops.compiled is runner.backend.cpu_kernels is not None
    torch_bf16 = _mixed_logits(_runner(llama_dir, "torch", torch.bfloat16, device), adapter_dirs)
    ours_error = (ours - reference).abs().max().item()
    torch_error = (torch_bf16 - reference).abs().max().item()
    logit_range = (reference.max() - reference.min()).item()
    assert ours_error <= 1.5 * torch_error + 1e-3 * logit_range, (ours_error, torch_error, logit_range)


# ---- Triton warm-up ----------------------------------------------------------------------------------------------


def _variant(num_tokens: int, num_segments: int) -> tuple:
    """What decides a compiled variant: BLOCK_M, SEG_BLOCK and num_segments' integer specialization."""
    block_m, seg_block, _ = plan_tiles(num_tokens, num_segments)
    kind = "one" if num_segments == 1 else "div16" if num_segments % 16 == 0 else "any"
    return block_m, seg_block, kind


@pytest.mark.parametrize("max_segments", [1, 2, 9, 16, 17, 41, 65])
def test_warmup_batches_meet_every_variant(max_segments: int) -> None:
    warmed = {_variant(t, s) for t, s in warmup_batches(max_segments)}
    assert all(s <= max_segments for _, s in warmup_batches(max_segments))
    for num_segments in range(1, max_segments + 1):
        for num_tokens in range(num_segments, 80 * num_segments, max(1, num_segments // 3)):
            assert _variant(num_tokens, num_segments) in warmed, (num_tokens, num_segments)


def test_warmup_launches_each_batch_once_per_linear() -> None:
    backend = TritonBackend(TEST_DEVICE)  # the interpreter without a GPU: tiny shapes
    pool = [_weights(make_batch(CASES["mixed"], n, torch.float32), TEST_DEVICE) for n in (1, 3)]
    assert backend.warmup(pool, max_segments=3) == 2 * len(pool) * len(warmup_batches(3))
    assert TorchBackend(torch.device("cpu")).warmup(pool, max_segments=3) == 0  # nothing to compile on the CPU


@pytest.mark.skipif(not USES_GPU, reason="compiled variants exist only on a GPU")
def test_no_compile_after_warmup() -> None:
    from loraplex.kernels.lora_expand import _expand_kernel
    from loraplex.kernels.lora_shrink import _shrink_kernel

    def variants() -> int:
        return sum(len(entry[0]) for k in (_shrink_kernel, _expand_kernel) for entry in k.device_caches.values())

    backend = TritonBackend(TEST_DEVICE)
    b = make_batch(CASES["many_slots"], 3, torch.float16)
    w = _weights(b, TEST_DEVICE)
    backend.warmup([w], max_segments=w.lora_a.shape[0] + 1)
    compiled = variants()
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        num_segments = int(torch.randint(1, w.lora_a.shape[0] + 2, (1,), generator=gen))
        lens = torch.randint(1, 80, (num_segments,), generator=gen).tolist()
        slots = torch.randint(-1, w.lora_a.shape[0], (num_segments,), generator=gen).tolist()
        meta = backend.prepare([0, *torch.tensor(lens).cumsum(0).tolist()], slots)
        x = torch.randn(sum(lens), b.x.shape[1], device=TEST_DEVICE, dtype=torch.float16)
        y = torch.zeros(sum(lens), b.y.shape[1], device=TEST_DEVICE, dtype=torch.float16)
        backend.shrink_expand(y, x, w, meta)
    torch.cuda.synchronize()
    assert variants() == compiled
