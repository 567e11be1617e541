"""MoE routing on the device (what CUDA graphs capture): the grouped expert kernel against its torch reference (Triton
in the interpreter without a GPU: fp32, fp16 and MXFP4, shapes with tails and an expert without rows; compiled for
sm_90 and sm_80 ahead of time), the device-built routing and expert LoRA segments against the host-built ones, and a
tiny MoE model with two adapters decoding through the graphs' static buffers on device routing equal to the normal
host path, its forward free of host reads."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from loraplex.kernels import select_backend
from loraplex.kernels.moe_matmul import moe_matmul_triton
from loraplex.worker.layers.attention import AttentionBackendError
from loraplex.worker.layers.moe import ExpertsLinear, Routing, use_device_routing, warm_up_device_routing
from loraplex.worker.lora.experts import device_expert_segments, expert_segments
from loraplex.worker.lora.layers import LoRABatchInfo
from loraplex.worker.lora.manager import LoRAManager
from loraplex.worker.model_runner import ModelRunner
from torch.utils._python_dispatch import TorchDispatchMode

import tests.triton_aot as triton_aot
from tests.device_helpers import TEST_DEVICE
from tests.kernel_refs import moe_matmul_torch
from tests.lora_helpers import decode_steps, load_all
from tests.moe_models import build_moe_set
from tests.worker_helpers import make_runner, random_prompts

NUM_EXPERTS, TOP_K = 5, 2


def _routing(num_tokens: int, seed: int, *, on_device: bool) -> Routing:
    """Each token's two experts among the first four: expert 4 gets no row."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(NUM_EXPERTS - 1, generator=generator)[:TOP_K] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, TOP_K, generator=generator)
    return Routing.build(ids.to(TEST_DEVICE), weights.to(TEST_DEVICE), NUM_EXPERTS, on_device=on_device)


def test_device_routing_equals_the_host_routing() -> None:
    host, device = _routing(13, 0, on_device=False), _routing(13, 0, on_device=True)
    assert device.on_device and not host.on_device and device.expert_bounds is None
    assert device.expert_indptr.tolist() == host.expert_bounds and host.expert_bounds[-2:] == [26, 26]
    assert device.token_ids.tolist() == host.host_token_ids
    torch.testing.assert_close(device.row_weights, host.row_weights, atol=0, rtol=0)
    bounds = torch.tensor(host.expert_bounds)
    assert device.row_experts.tolist() == torch.repeat_interleave(torch.arange(NUM_EXPERTS), bounds.diff()).tolist()


@pytest.mark.parametrize("dtype, mxfp4", [(torch.float32, False), (torch.float16, False), (torch.float32, True)],
                         ids=["fp32", "fp16", "mxfp4"])  # fmt: skip
def test_grouped_kernel_equals_torch(dtype: torch.dtype, mxfp4: bool) -> None:
    # 70 outputs and 96 inputs: tails of the 64-output and 32-input blocks; 26 rows over four experts, one expert empty
    routing = _routing(13, 1, on_device=True)
    generator = torch.Generator().manual_seed(2)
    num_out, num_in = 70, 96
    rows = torch.randn(26, num_in, generator=generator).to(TEST_DEVICE, dtype)
    bias = torch.randn(NUM_EXPERTS, num_out, generator=generator).to(TEST_DEVICE, dtype)
    if mxfp4:
        weight = torch.randint(0, 256, (NUM_EXPERTS, num_out, num_in // 2), generator=generator, dtype=torch.uint8)
        scales = torch.randint(122, 130, (NUM_EXPERTS, num_out, num_in // 32), generator=generator, dtype=torch.uint8)
        weight, scales = weight.to(TEST_DEVICE), scales.to(TEST_DEVICE)
    else:
        weight, scales = (
            (torch.randn(NUM_EXPERTS, num_out, num_in, generator=generator) * 0.3).to(TEST_DEVICE, dtype),
            None,
        )
    args = (rows, weight, routing.expert_indptr, routing.expert_ids(), bias, scales)
    ours, ref = moe_matmul_triton(*args), moe_matmul_torch(*args)
    tolerance = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(ours, ref, **tolerance)
    with pytest.raises(ValueError, match="expert_ids must be a contiguous int32"):
        moe_matmul_triton(rows, weight, routing.expert_indptr, routing.expert_ids().long(), bias, scales)


def test_grouped_kernel_compiles_for_sm90_and_sm80_as_warmed_up() -> None:
    """In a child without the interpreter (tests/triton_aot.py `moe`): every variant a sweep of decode batches and
    prefills launches is one the start-up warm-up (warm_up_device_routing) compiled, within shared memory."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "triton_aot.py"), "moe"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert len(results) == 2 * len(triton_aot.MOE_CONFIGS)
    for r in results:
        where = f"sm_{r['arch']} {r['dtype']} mxfp4={r['mxfp4']} {r['shape']}"
        assert len(r["launches"]) == 2 * len(triton_aot.MOE_TOKENS), where  # gate_up and down per batch
        assert set(r["serving_keys"]) <= set(r["warmup_keys"]), where
        for c in r["compiled"]:
            assert 0 < c["shared_bytes"] <= triton_aot.SHARED_LIMIT[r["arch"]], (where, c["shared_bytes"])


def _row_slots(meta, num_rows: int) -> list[int]:
    """Each row's (virtual) slot as a segment list says it."""
    indptr, slots = meta.seg_indptr.tolist(), meta.seg_slots.tolist()
    assert indptr[0] == 0 and indptr[-1] == num_rows
    return [slot for slot, start, end in zip(slots, indptr, indptr[1:], strict=False) for _ in range(start, end)]


def test_device_expert_segments_equal_the_host_ones() -> None:
    # the batch's token segments: base, slot 0, slot 1, base, slot 0, then two empty padding segments (a graph's);
    # each token's request strength (lora_scale) too
    seg_indptr, seg_slots = [0, 3, 7, 9, 11, 14, 14, 14], [-1, 0, 1, -1, 0, -1, -1]
    token_scales = [0.5 + 0.1 * token for token in range(14)]
    backend = select_backend("triton", TEST_DEVICE, torch.float32)
    batch = LoRABatchInfo(backend=backend, host_segments=(seg_indptr[:6], seg_slots[:5]), host_row_scales=token_scales)
    batch.meta = backend.prepare(seg_indptr, seg_slots, token_scales)
    host_routing = _routing(14, 3, on_device=False)
    host = expert_segments(host_routing, batch)
    device = device_expert_segments(_routing(14, 3, on_device=True), batch)
    assert device.seg_slots.shape[0] == 28  # min(rows, experts * segments): a bound from shapes alone
    assert _row_slots(device, 28) == _row_slots(host, 28)
    assert device.plan == backend.plan([28], [0] * 28)
    torch.testing.assert_close(device.row_scales, host.row_scales, atol=0, rtol=0)
    expected = torch.tensor([token_scales[token] for token in host_routing.host_token_ids], device=TEST_DEVICE)
    assert torch.equal(device.row_scales, expected)  # each row its own token's strength


@pytest.fixture(scope="module")
def moe_set(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    # one layer: the interpreter runs every LoRA and expert kernel program by program
    return build_moe_set(tmp_path_factory.mktemp("moe_graphs"), "mixtral", num_hidden_layers=1)


def _runner(moe_set, backend: str) -> ModelRunner:
    model_dir, adapters = moe_set
    with pytest.MonkeyPatch.context() as patch:
        # the interpreter would spend minutes on the start-up compile warm-up, which compiles nothing there
        patch.setattr(LoRAManager, "warmup", lambda self: None)
        runner = make_runner(model_dir, dtype="float32", attention_backend=backend, lora_backend=backend,
                             enable_cuda_graph=True, max_running_requests=4, enable_lora=True, max_lora_rank=8,
                             lora_target_modules=["all"], max_loras_per_batch=3)  # fmt: skip
    load_all(runner, adapters)
    return runner


@pytest.fixture(scope="module")
def triton_runner(moe_set) -> ModelRunner:
    return _runner(moe_set, "triton")


class _NoSyncingOps(TorchDispatchMode):
    """Fails on every op that reads a device tensor back to the host, or waits for one to size its output."""

    SYNCING = ("_local_scalar_dense", "nonzero", "bincount", "masked_select", "repeat_interleave", "item")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.SYNCING or "unique" in name:
            raise AssertionError(f"host read in the captured step: {func}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """What a CUDA graph capture needs of the step: no syncing op, and no tolist (which bypasses the dispatcher)."""

    def refuse(self):
        raise AssertionError("host read in the captured step: tolist")

    tolist = torch.Tensor.tolist
    torch.Tensor.tolist = refuse
    try:
        with _NoSyncingOps():
            yield
    finally:
        torch.Tensor.tolist = tolist


def _guarded(graphs) -> None:
    """Every step of `graphs` (a DecodeGraphRunner) runs under no_host_reads, as a capture would record it."""
    run = graphs._run

    def run_without_host_reads(entry):
        with no_host_reads():
            return run(entry)

    graphs._run = run_without_host_reads


def test_moe_decoding_on_device_routing_equals_the_host_path(moe_set, triton_runner: ModelRunner) -> None:
    """Base rows and both adapters: a mixed prefill, then 3 and 1 requests decoding (graphs of 4 and 1 rows). The
    reference: the normal path, routing on the host, torch LoRA and SDPA; ours: device routing, Triton, and the decode
    steps through the graphs' static buffers with no host read in them."""
    names = [None, "a4", "a8", "a4"]
    prompts = random_prompts([5, 3, 6, 4], 256, seed=7)
    stops = [3, 2, 2, 1]
    eager = _runner(moe_set, "torch")
    tokens_ref, logits_ref = decode_steps(eager, prompts, names, stops)
    host_routed = eager.graph_runner(capture=False, batch_sizes=[1])
    _guarded(host_routed)  # the guard is not vacuous: host routing trips it
    with pytest.raises(AssertionError, match="host read in the captured step"):
        host_routed._run(host_routed.entries[1])

    graphed = triton_runner
    assert use_device_routing(graphed.model) == 1
    assert warm_up_device_routing(graphed.model) == 6  # gate_up and down, three row tiles each
    graphed.decode_graphs = graphed.graph_runner(capture=False)
    _guarded(graphed.decode_graphs)
    tokens, logits = decode_steps(graphed, prompts, names, stops)
    assert tokens == tokens_ref
    for step, (ours, ref) in enumerate(zip(logits, logits_ref, strict=True)):
        assert (ours - ref).abs().max().item() <= 1e-4, f"step {step}"


def test_graphs_refuse_an_expert_format_the_kernel_does_not_read(
    triton_runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    linear = next(m for m in triton_runner.model.modules() if isinstance(m, ExpertsLinear))
    # an int8 weight stands in for a format the grouped kernel does not read
    monkeypatch.setattr(linear.weight, "data", linear.weight.data.to(torch.int8))
    monkeypatch.setattr(triton_runner, "device", torch.device("cuda"))  # as on a GPU: checked before any device work
    with pytest.raises(AttentionBackendError, match="cannot capture these MoE layers: .*int8 weights"):
        triton_runner._decode_graphs()
