"""Expert LoRA through each backend's segmented kernels: an MoE layer's rows (token, expert), regrouped into runs of
one (expert, slot) and read from the pool's (slot, expert) rows as virtual slots (worker/lora/experts.py), must give
every row its own adapter's and its own expert's product, against a float64 per-row reference. Triton runs in the
interpreter without a GPU (fp32 and fp16), the CPU kernels in bfloat16 where they build."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from loraplex.kernels import cpu_ext, select_backend
from loraplex.worker.layers.moe import Routing
from loraplex.worker.lora.experts import expert_segments
from loraplex.worker.lora.layers import LoRABatchInfo

from tests.device_helpers import TEST_DEVICE, USES_GPU

NUM_EXPERTS, NUM_SLOTS, TOP_K = 4, 3, 2
MAX_RANK, IN_DIM, SLICE_OUT = 8, 64, (48, 48)
SLOT_RANKS = (8, 4, 0)  # slot 2 holds an adapter that does not target this linear (rank 0 there): its rows unchanged
# the batch's token segments: base rows, then slots 0, 1, base, 0 again
SEG_INDPTR, SEG_SLOTS = [0, 3, 7, 9, 11, 14], [-1, 0, 1, -1, 0]
CPU_KERNELS_OFF = cpu_ext.unavailable_reason()
CASES = [
    pytest.param("torch", torch.float32, id="torch-fp32"),
    pytest.param("triton", torch.float32, id="triton-fp32"),
    pytest.param("triton", torch.float16, id="triton-fp16"),
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16", marks=pytest.mark.skipif(
        USES_GPU or CPU_KERNELS_OFF is not None, reason=f"the CPU kernels cannot run here: {CPU_KERNELS_OFF}")),
]  # fmt: skip
TOLERANCES = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-2, rtol=1e-2),
              torch.bfloat16: dict(atol=1e-1, rtol=2e-2)}  # fmt: skip


def expert_weights(dtype: torch.dtype, device: torch.device, generator: torch.Generator) -> SimpleNamespace:
    """A pool's experts' linear of two slices: every tensor with one row per (slot, expert), zero past each rank."""
    num_rows, num_slices = NUM_SLOTS * NUM_EXPERTS, len(SLICE_OUT)
    lora_a = torch.randn(num_rows, num_slices * MAX_RANK, IN_DIM, generator=generator) * 0.1
    lora_b = torch.randn(num_rows, MAX_RANK, sum(SLICE_OUT), generator=generator) * 0.1
    ranks = [SLOT_RANKS[row // NUM_EXPERTS] for row in range(num_rows)]
    for row, rank in enumerate(ranks):
        lora_a.view(num_rows, num_slices, MAX_RANK, IN_DIM)[row, :, rank:] = 0
        lora_b[row, rank:] = 0
    scales = [0.5 + row // NUM_EXPERTS for row in range(num_rows)]
    offsets = (0, SLICE_OUT[0], sum(SLICE_OUT))
    return SimpleNamespace(
        lora_a=lora_a.to(device, dtype), lora_b=lora_b.to(device, dtype),
        slice_offsets=torch.tensor(offsets, dtype=torch.int32, device=device), row_offsets=offsets,
        slot_ranks=torch.tensor(ranks, dtype=torch.int32, device=device),
        slot_scales=torch.tensor(scales, dtype=torch.float32, device=device), host_ranks=ranks, host_scales=scales,
        num_slices=num_slices,
    )  # fmt: skip


def reference(y: torch.Tensor, rows: torch.Tensor, w: SimpleNamespace, routing: Routing) -> torch.Tensor:
    """Row by row in float64: y[row] += scale · (x · A[slot, expert]ᵀ) · B[slot, expert] for each slice."""
    token_slots = torch.repeat_interleave(torch.tensor(SEG_SLOTS), torch.tensor(SEG_INDPTR).diff())
    out = y.double().cpu()
    a, b = w.lora_a.double().cpu(), w.lora_b.double().cpu()
    for row, token in enumerate(routing.host_token_ids):
        expert = next(e for e in range(NUM_EXPERTS) if routing.expert_bounds[e] <= row < routing.expert_bounds[e + 1])
        slot = int(token_slots[token])
        if slot < 0:
            continue
        virtual = slot * NUM_EXPERTS + expert
        for s in range(w.num_slices):
            h = rows[row].double().cpu() @ a[virtual, s * MAX_RANK : (s + 1) * MAX_RANK].T  # (max_rank,)
            cols = slice(w.row_offsets[s], w.row_offsets[s + 1])
            out[row, cols] += w.host_scales[virtual] * (h @ b[virtual, :, cols])
    return out


@pytest.mark.parametrize("backend_name, dtype", CASES)
def test_expert_rows_get_their_own_adapter_and_expert(backend_name: str, dtype: torch.dtype) -> None:
    device = torch.device("cpu") if backend_name == "cpu" else TEST_DEVICE
    backend = select_backend(backend_name, device, dtype)
    generator = torch.Generator().manual_seed(5)
    num_tokens = SEG_INDPTR[-1]
    topk = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K] for _ in range(num_tokens)])
    routing = Routing.build(topk, torch.rand(num_tokens, TOP_K, generator=generator), NUM_EXPERTS)
    x = torch.randn(num_tokens, IN_DIM, generator=generator)
    rows = x[routing.token_ids].to(device, dtype)  # (rows, in)
    w = expert_weights(dtype, device, generator)
    meta = expert_segments(routing, LoRABatchInfo(backend=backend, host_segments=(SEG_INDPTR, SEG_SLOTS)))
    assert meta is not None and meta.seg_slots.shape[0] > NUM_SLOTS  # runs of one (expert, slot): many segments
    y = (torch.randn(rows.shape[0], sum(SLICE_OUT), generator=generator) * 0.1).to(device, dtype)
    before = y.double().cpu()
    expected = reference(y, rows, w, routing)
    backend.shrink_expand(y, rows, w, meta)
    torch.testing.assert_close(y.double().cpu(), expected, **TOLERANCES[dtype])
    assert (expected - before).abs().max() > 0.05  # the adapters' products are not lost in the tolerance


def test_base_only_rows_have_no_segments() -> None:
    backend = select_backend("torch", "cpu", torch.float32)
    routing = Routing.build(torch.tensor([[0, 1], [2, 1]]), torch.ones(2, 2), NUM_EXPERTS)
    assert expert_segments(routing, LoRABatchInfo(backend=backend, host_segments=([0, 2], [-1]))) is None
