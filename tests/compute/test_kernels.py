from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace

import pytest
import torch
from loraplex.kernels import (
    cpu_ext,
    lora_expand_triton,
    lora_shrink_triton,
    lora_torch,
)

from tests import kernel_refs
from tests.device_helpers import TEST_DEVICE  # conftest has set TRITON_INTERPRET where no GPU is used
from tests.kernel_refs import (
    lora_expand_torch,
    lora_shrink_expand_torch,
    lora_shrink_expand_triton,
    lora_shrink_torch,
)

IN_DIM = 80  # not a multiple of the shrink K block, so the K mask is exercised
TOLERANCES = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2)}
SLICE_OUTS = {1: [40], 3: [64, 32, 32]}


@dataclass(frozen=True)
class Case:
    seg_lens: list[int]
    seg_slots: list[int]
    slot_ranks: list[int]
    max_rank: int


CASES = {
    # ranks 1..64 in one batch; empty, single-row and long segments; base rows between adapters
    "mixed": Case([0, 1, 37, 3, 5, 0, 9, 2, 4], [2, 0, 3, -1, 1, 3, -1, 2, -1], [1, 4, 16, 64], 64),
    "all_base": Case([5, 0, 7], [-1, -1, -1], [4, 16], 16),
    # one row per segment, as in decode, more segments than one scan block; slot 1 is empty (rank 0)
    "decode": Case([1] * 20, [0, 1, -1, 2, 0] * 4, [8, 0, 3], 8),
    # segments over the largest row tile, and a pool wider than one rank block
    "long": Case([150, 2, 70], [1, -1, 0], [100, 3], 128),
    "no_tokens": Case([0, 0], [0, -1], [4], 16),
    # a decode batch sorted by slot, as the scheduler sends it: the CPU path runs it as one group over a view of
    # slots 0..6, where slot 1 is a gap (no request) and slot 4 holds an adapter that does not target this module
    "decode_sorted": Case([2, 1, 1, 3, 1, 1, 1], [-1, 0, 2, 3, 4, 5, 6], [8, 4, 3, 16, 0, 2, 8], 16),
    # a prefill chunk (its own matmul) beside decodes of other slots, grouped around it
    "prefill_and_decodes": Case([20, 1, 2, 1], [1, 0, 2, 3], [4, 8, 16, 2], 16),
    # one row per slot but not in slot order: one group, whose rows must go back to their places
    "unsorted_decode": Case([1, 1, 1], [2, 0, 1], [4, 8, 4], 8),
    # short segments too far apart in the pool for a view: their weights are gathered
    "sparse_slots": Case([1, 2, 1], [0, 1, 40], [4] * 41, 4),
    # more rows x slots than one group takes: the short segments split into several groups
    "many_slots": Case([1, 2, 1] * 16, list(range(48)), [1 + s % 8 for s in range(48)], 8),
}


@dataclass
class Batch:
    x: torch.Tensor  # (tokens, in_dim)
    lora_a: torch.Tensor  # (slots, slices * max_rank, in_dim)
    lora_b: torch.Tensor  # (slots, max_rank, out_dim)
    h: torch.Tensor  # (tokens, slices * max_rank), random everywhere: kernels must ignore rows/columns they do not own
    y: torch.Tensor  # (tokens, out_dim)
    seg_indptr: torch.Tensor
    seg_slots: torch.Tensor
    slot_ranks: torch.Tensor
    slot_scales: torch.Tensor
    slice_offsets: torch.Tensor
    num_slices: int


def make_batch(case: Case, num_slices: int, dtype: torch.dtype, seed: int = 0, in_dim: int = IN_DIM) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(case.seg_lens)
    num_slots = len(case.slot_ranks)
    slice_outs = SLICE_OUTS[num_slices]
    out_dim = sum(slice_outs)
    max_rank = case.max_rank

    lora_a = torch.randn(num_slots, num_slices, max_rank, in_dim, generator=gen) / in_dim**0.5
    lora_b = torch.randn(num_slots, max_rank, out_dim, generator=gen) / max_rank**0.5
    for slot, rank in enumerate(case.slot_ranks):  # the pool is zero past each adapter's rank
        lora_a[slot, :, rank:] = 0
        lora_b[slot, rank:] = 0
    slice_offsets = torch.tensor([0, *slice_outs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seg_indptr = torch.tensor([0, *case.seg_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return Batch(
        x=torch.randn(num_tokens, in_dim, generator=gen).to(dtype),
        lora_a=lora_a.reshape(num_slots, num_slices * max_rank, in_dim).to(dtype),
        lora_b=lora_b.to(dtype),
        h=torch.randn(num_tokens, num_slices * max_rank, generator=gen).to(dtype),
        y=torch.randn(num_tokens, out_dim, generator=gen).to(dtype),
        seg_indptr=seg_indptr,
        seg_slots=torch.tensor(case.seg_slots, dtype=torch.int32),
        slot_ranks=torch.tensor(case.slot_ranks, dtype=torch.int32),
        slot_scales=torch.linspace(0.5, 2.0, num_slots, dtype=torch.float32),
        slice_offsets=slice_offsets,
        num_slices=num_slices,
    )


def on_test_device(b: Batch) -> Batch:
    """The batch where the Triton kernels run: the GPU, or the CPU under Triton's interpreter."""
    return replace(b, **{f.name: getattr(b, f.name).to(TEST_DEVICE) for f in fields(b) if f.name != "num_slices"})


def row_slots(b: Batch) -> list[int]:
    bounds = b.seg_indptr.tolist()
    return [slot for seg, slot in enumerate(b.seg_slots.tolist()) for _ in range(bounds[seg], bounds[seg + 1])]


def dense_shrink(b: Batch) -> torch.Tensor:
    # Per-row oracle in float64 over the full zero-padded pool; ignores slot_ranks on purpose.
    h = torch.zeros(b.x.shape[0], b.lora_a.shape[1], dtype=torch.float64)
    for row, slot in enumerate(row_slots(b)):
        if slot >= 0:
            h[row] = b.lora_a[slot].double() @ b.x[row].double()
    return h


def dense_expand(b: Batch) -> torch.Tensor:
    y = b.y.double().clone()
    max_rank = b.h.shape[1] // b.num_slices
    bounds = b.slice_offsets.tolist()
    for row, slot in enumerate(row_slots(b)):
        if slot < 0:
            continue
        for s in range(b.num_slices):
            h_slice = b.h[row, s * max_rank : (s + 1) * max_rank].double()
            b_slice = b.lora_b[slot, :, bounds[s] : bounds[s + 1]].double()  # (max_rank, slice_out)
            y[row, bounds[s] : bounds[s + 1]] += b.slot_scales[slot].item() * (h_slice @ b_slice)
    return y


def shrink_args(b: Batch) -> tuple:
    return (b.x, b.lora_a, b.seg_indptr, b.seg_slots, b.slot_ranks, b.num_slices)


def expand_args(b: Batch, y: torch.Tensor) -> tuple:
    return (y, b.h, b.lora_b, b.seg_indptr, b.seg_slots, b.slot_ranks, b.slot_scales, b.slice_offsets)


def base_rows(b: Batch) -> torch.Tensor:
    return torch.tensor([slot < 0 for slot in row_slots(b)], dtype=torch.bool)


def sweep_cases(test):
    test = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])(test)
    test = pytest.mark.parametrize("num_slices", [1, 3])(test)
    return pytest.mark.parametrize("case_name", list(CASES))(test)


@sweep_cases
def test_shrink(case_name: str, num_slices: int, dtype: torch.dtype) -> None:
    b = make_batch(CASES[case_name], num_slices, dtype)
    h_ref = lora_shrink_torch(*shrink_args(b))
    h_tri = lora_shrink_triton(*shrink_args(on_test_device(b))).cpu()
    assert h_ref.shape == h_tri.shape == (b.x.shape[0], b.lora_a.shape[1])
    assert h_ref.dtype == h_tri.dtype == dtype
    torch.testing.assert_close(h_ref.double(), dense_shrink(b), **TOLERANCES[dtype])
    torch.testing.assert_close(h_tri, h_ref, **TOLERANCES[dtype])
    is_base = base_rows(b)
    assert torch.count_nonzero(h_tri[is_base]) == 0
    assert torch.count_nonzero(h_ref[is_base]) == 0


@sweep_cases
def test_expand(case_name: str, num_slices: int, dtype: torch.dtype) -> None:
    b = make_batch(CASES[case_name], num_slices, dtype)
    y_ref, y_tri = b.y.clone(), b.y.clone().to(TEST_DEVICE)
    assert lora_expand_torch(*expand_args(b, y_ref)) is None
    assert lora_expand_triton(*expand_args(on_test_device(b), y_tri)) is None
    y_tri = y_tri.cpu()
    torch.testing.assert_close(y_ref.double(), dense_expand(b), **TOLERANCES[dtype])
    torch.testing.assert_close(y_tri, y_ref, **TOLERANCES[dtype])
    is_base = base_rows(b)
    assert torch.equal(y_tri[is_base], b.y[is_base])
    assert torch.equal(y_ref[is_base], b.y[is_base])


def test_torch_path_replans_when_metadata_changes_in_place() -> None:
    # The torch path keeps the last segment plan, keyed by the metadata tensors: an in-place edit must not reuse it.
    b = make_batch(CASES["decode_sorted"], 1, torch.float32)
    lora_shrink_torch(*shrink_args(b))
    b.seg_slots[1:] = torch.tensor([6, 5, 3, 2, 0, 4], dtype=torch.int32)
    h = lora_shrink_torch(*shrink_args(b))
    torch.testing.assert_close(h.double(), dense_shrink(b), **TOLERANCES[torch.float32])
    y = b.y.clone()
    lora_expand_torch(*expand_args(b, y))
    torch.testing.assert_close(y.double(), dense_expand(b), **TOLERANCES[torch.float32])


def _plan_of(case_name: str):
    b = make_batch(CASES[case_name], 1, torch.float32)
    return kernel_refs._plan(b.seg_indptr, b.seg_slots)


def test_torch_path_groups() -> None:
    # How the CPU path lays out each kind of batch (the cases above check that every layout computes the same).
    plan = _plan_of("decode_sorted")  # base rows left out, slots 0..6 one view, the gap and rank-0 slot included
    [group] = plan.groups
    assert group.slots == slice(0, 7) and group.rows is not None and not plan.separate
    plan = _plan_of("prefill_and_decodes")
    assert [(s.slot, s.num_rows) for s in plan.separate] == [(1, 20)] and plan.groups[0].slots == slice(0, 4)
    plan = _plan_of("sparse_slots")
    assert plan.groups[0].slots == (0, 1, 40) and plan.groups[0].rows is None  # gathered; every row, in order
    plan = _plan_of("many_slots")
    assert len(plan.groups) > 1
    assert all(len(g.own_columns) * g.num_slots <= lora_torch.MAX_GROUP_PAIRS for g in plan.groups)
    assert sum(len(g.own_columns) for g in plan.groups) == sum(CASES["many_slots"].seg_lens)


@pytest.mark.parametrize("inference_pool", [False, True])
def test_gathered_weights_follow_pool_writes(inference_pool: bool) -> None:
    # Scattered slots' weights are gathered once and kept: a write to the pool (a slot load) must show in the next call.
    b = make_batch(CASES["sparse_slots"], 3, torch.float32)
    if inference_pool:  # a pool made under inference mode has no version counter: gathered afresh every call
        with torch.inference_mode():
            b.lora_a, b.lora_b = b.lora_a.clone(), b.lora_b.clone()
    for _ in range(2):
        lora_shrink_torch(*shrink_args(b))
        lora_expand_torch(*expand_args(b, b.y.clone()))
    with torch.inference_mode():  # the worker loads slots inside its forward
        b.lora_a[40, :, :].mul_(-3.0)
        b.lora_b[40, :2].mul_(0.5)
    h = lora_shrink_torch(*shrink_args(b))
    torch.testing.assert_close(h.double(), dense_shrink(b), **TOLERANCES[torch.float32])
    y = b.y.clone()
    lora_expand_torch(*expand_args(b, y))
    torch.testing.assert_close(y.double(), dense_expand(b), **TOLERANCES[torch.float32])


def shrink_expand_args(b: Batch, y: torch.Tensor) -> tuple:
    return (y, b.x, b.lora_a, b.lora_b, b.seg_indptr, b.seg_slots, b.slot_ranks, b.slot_scales, b.slice_offsets)


def dense_shrink_expand(b: Batch) -> torch.Tensor:
    # h rounds to the batch's dtype between the two products, as in any shrink then expand
    return dense_expand(replace(b, h=dense_shrink(b).to(b.x.dtype)))


@sweep_cases
def test_shrink_expand(case_name: str, num_slices: int, dtype: torch.dtype) -> None:
    b = make_batch(CASES[case_name], num_slices, dtype)
    y = b.y.clone()
    assert lora_shrink_expand_torch(*shrink_expand_args(b, y)) is None
    torch.testing.assert_close(y.double(), dense_shrink_expand(b), **TOLERANCES[dtype])
    is_base = base_rows(b)
    assert torch.equal(y[is_base], b.y[is_base])


CPU_KERNELS_OFF = cpu_ext.unavailable_reason()
BF16_TOL = dict(atol=3e-2, rtol=2e-2)


@pytest.mark.skipif(CPU_KERNELS_OFF is not None, reason=f"CPU LoRA kernels cannot run here: {CPU_KERNELS_OFF}")
@pytest.mark.parametrize("compiled_rows", [None, 4], ids=["default", "long_segments_as_matmuls"])
@pytest.mark.parametrize("num_slices", [1, 3])
@pytest.mark.parametrize("case_name", list(CASES))
def test_cpu_kernels(
    case_name: str, num_slices: int, compiled_rows: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # bfloat16 short rows go to the compiled AVX-512 kernels (built on first use): they must match the float64
    # reference, leave base rows alone, and agree with the torch ops that run where the kernels cannot. With a
    # low limit, longer segments take their own matmuls beside the kernels' rows.
    assert cpu_ext.kernels() is not None, "the CPU kernels failed to build (see the log)"
    if compiled_rows is not None:
        monkeypatch.setattr(lora_torch, "COMPILED_SEGMENT_ROWS", compiled_rows)
    b = make_batch(CASES[case_name], num_slices, torch.bfloat16)
    h = lora_shrink_torch(*shrink_args(b))
    y = b.y.clone()
    lora_expand_torch(*expand_args(b, y))
    torch.testing.assert_close(h.double(), dense_shrink(b), **BF16_TOL)
    torch.testing.assert_close(y.double(), dense_expand(b), **BF16_TOL)
    is_base = base_rows(b)
    assert torch.count_nonzero(h[is_base]) == 0 and torch.equal(y[is_base], b.y[is_base])
    # one call for both: the same kernels (and matmuls for long segments), so the same bits as the two calls
    y_fused = b.y.clone()
    lora_shrink_expand_torch(*shrink_expand_args(b, y_fused))
    y_two = b.y.clone()
    lora_expand_torch(*expand_args(replace(b, h=h), y_two))
    assert torch.equal(y_fused, y_two)
    monkeypatch.setattr(cpu_ext, "kernels", lambda: None)
    y_ops = b.y.clone()
    lora_expand_torch(*expand_args(b, y_ops))
    torch.testing.assert_close(lora_shrink_torch(*shrink_args(b)), h, **BF16_TOL)
    torch.testing.assert_close(y_ops, y, **BF16_TOL)


def test_expand_updates_strided_view() -> None:
    # y is often a column slice of a fused output; only unit stride in the last dim is required.
    b = make_batch(CASES["mixed"], 3, torch.float32)
    fused = torch.randn(b.y.shape[0], b.y.shape[1] + 16)
    fused[:, 16:] = b.y
    before = fused.clone()
    fused = fused.to(TEST_DEVICE)
    lora_expand_triton(*expand_args(on_test_device(b), fused[:, 16:]))
    fused = fused.cpu()
    torch.testing.assert_close(fused[:, 16:].double(), dense_expand(b), **TOLERANCES[torch.float32])
    assert torch.equal(fused[:, :16], before[:, :16])


def test_triton_shrink_expand_is_shrink_then_expand() -> None:
    b = make_batch(CASES["prefill_and_decodes"], 3, torch.float32)
    on_device = on_test_device(b)
    y = on_device.y.clone()
    lora_shrink_expand_triton(*shrink_expand_args(on_device, y))
    torch.testing.assert_close(y.cpu().double(), dense_shrink_expand(b), **TOLERANCES[torch.float32])


BAD_SHRINK_EXPAND = {  # argument -> (replacement, what the compiled kernel's refusal names)
    "y": (lambda b: b.y[:-1], "x and y must be (rows, features)"),
    "x": (lambda b: b.x.float(), "must be bfloat16"),
    "lora_b": (lambda b: b.lora_b[:, :, :-1], "must match x and y"),
    "slice_offsets": (lambda b: b.slice_offsets.flip(0), "slice_offsets must rise from 0"),
    "row_slot": (lambda b: torch.full((b.x.shape[0],), b.lora_a.shape[0], dtype=torch.int64), "of a pool of"),
    "slot_scales": (lambda b: b.slot_scales.double(), "slot_scales (slots,) float32"),
}


@pytest.mark.skipif(CPU_KERNELS_OFF is not None, reason=f"CPU LoRA kernels cannot run here: {CPU_KERNELS_OFF}")
@pytest.mark.parametrize("bad", list(BAD_SHRINK_EXPAND))
def test_compiled_shrink_expand_rejects(bad: str) -> None:
    b = make_batch(CASES["mixed"], 3, torch.bfloat16)
    args = dict(y=b.y.clone(), x=b.x, lora_a=b.lora_a, lora_b=b.lora_b,
                row_slot=torch.tensor([max(s, -1) for s in row_slots(b)], dtype=torch.int64),
                slot_ranks=b.slot_ranks, slot_scales=b.slot_scales, slice_offsets=b.slice_offsets)  # fmt: skip
    make, message = BAD_SHRINK_EXPAND[bad]
    args[bad] = make(b)
    before = args["y"].clone()
    with pytest.raises(RuntimeError, match=re.escape(message)):
        cpu_ext.kernels().shrink_expand(*args.values())
    if bad != "y":
        assert torch.equal(args["y"], before)  # refused before writing anything


def _int64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64)


def _drop_last(t: torch.Tensor) -> torch.Tensor:
    return t[:-1]


# name -> (edits to the valid arguments, expected message)
BAD_SHRINK = {
    "x_1d": (dict(x=lambda t: t[0]), "x must be 2-D"),
    "x_column_major": (dict(x=lambda t: t.T.contiguous().T), "unit stride"),
    "in_dim": (dict(x=lambda t: t[:, :-1].contiguous()), "in_dim"),
    "dtype_mismatch": (dict(x=lambda t: t.half()), "must match x dtype"),
    "indptr_int64": (dict(seg_indptr=_int64), "seg_indptr must be torch.int32"),
    "indptr_len": (dict(seg_indptr=_drop_last), "num_segments \\+ 1"),
    "ranks_len": (dict(slot_ranks=_drop_last), "slot_ranks must have num_slots"),
    "num_slices": (dict(num_slices=lambda n: 5), "num_slices"),
}
BAD_EXPAND = {
    "y_rows": (dict(y=_drop_last), "rows"),
    "h_dtype": (dict(h=lambda t: t.half()), "must match y dtype"),
    "b_out_dim": (dict(lora_b=lambda t: t[:, :, :-1].contiguous()), "lora_b must be"),
    "b_rank": (dict(lora_b=lambda t: t[:, :-1].contiguous()), "lora_b must be"),
    "b_noncontiguous": (dict(lora_b=lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
    "scales_dtype": (dict(slot_scales=lambda t: t.double()), "slot_scales must be torch.float32"),
    "scales_len": (dict(slot_scales=_drop_last), "slot_scales must have num_slots"),
    "offsets_len": (
        dict(slice_offsets=lambda t: torch.tensor([0, 8, 16, 24, 32, 40], dtype=torch.int32)),
        "num_slices",
    ),
    "slots_int64": (dict(seg_slots=_int64), "seg_slots must be torch.int32"),
}


def _apply(args: dict, edits: dict) -> dict:
    return {name: edits[name](value) if name in edits else value for name, value in args.items()}


@pytest.mark.parametrize("shrink", [lora_shrink_torch, lora_shrink_triton])
@pytest.mark.parametrize("bad", list(BAD_SHRINK))
def test_shrink_rejects(shrink, bad: str) -> None:
    edits, message = BAD_SHRINK[bad]
    b = make_batch(CASES["mixed"], 1, torch.float32)
    args = dict(
        x=b.x, lora_a=b.lora_a, seg_indptr=b.seg_indptr, seg_slots=b.seg_slots,
        slot_ranks=b.slot_ranks, num_slices=b.num_slices,
    )  # fmt: skip
    with pytest.raises(ValueError, match=message):
        shrink(**_apply(args, edits))


@pytest.mark.parametrize("expand", [lora_expand_torch, lora_expand_triton])
@pytest.mark.parametrize("bad", list(BAD_EXPAND))
def test_expand_rejects(expand, bad: str) -> None:
    edits, message = BAD_EXPAND[bad]
    b = make_batch(CASES["mixed"], 1, torch.float32)
    args = dict(
        y=b.y.clone(), h=b.h, lora_b=b.lora_b, seg_indptr=b.seg_indptr, seg_slots=b.seg_slots,
        slot_ranks=b.slot_ranks, slot_scales=b.slot_scales, slice_offsets=b.slice_offsets,
    )  # fmt: skip
    with pytest.raises(ValueError, match=message):
        expand(**_apply(args, edits))


def test_row_scales() -> None:
    # Each row's request strength multiplies its adapter term (0 leaves the row as the base left it), in the torch
    # reference and the Triton kernels alike, and through each backend's prepare (the scales packed in its one copy).
    from loraplex.kernels.backend import TorchBackend, TritonBackend

    b = make_batch(CASES["prefill_and_decodes"], 3, torch.float32)  # a long segment and single rows, split-K planes
    gen = torch.Generator().manual_seed(1)
    row_scales = torch.rand(b.x.shape[0], generator=gen) * 4
    row_scales[::3] = 0.0
    expected = dense_expand(replace(b, h=dense_shrink(b) * row_scales.double()[:, None]))
    y_torch = b.y.clone()
    lora_shrink_expand_torch(*shrink_expand_args(b, y_torch), row_scales)
    torch.testing.assert_close(y_torch.double(), expected, **TOLERANCES[torch.float32])
    on_device = on_test_device(b)

    @dataclass
    class Weights:  # kernels/backend.py's LoRAWeights over the batch's tensors
        lora_a: torch.Tensor
        lora_b: torch.Tensor
        slice_offsets: torch.Tensor
        slot_ranks: torch.Tensor
        slot_scales: torch.Tensor
        num_slices: int

        def __post_init__(self) -> None:
            self.row_offsets = tuple(self.slice_offsets.tolist())
            self.host_ranks, self.host_scales = self.slot_ranks.tolist(), self.slot_scales.tolist()

    for backend, batch in ((TorchBackend("cpu"), b), (TritonBackend(TEST_DEVICE), on_device)):
        w = Weights(batch.lora_a, batch.lora_b, batch.slice_offsets, batch.slot_ranks, batch.slot_scales, 3)
        meta = backend.prepare(batch.seg_indptr.tolist(), batch.seg_slots.tolist(), row_scales.tolist())
        assert torch.equal(meta.row_scales.cpu(), row_scales) and torch.equal(meta.seg_slots.cpu(), b.seg_slots)
        y = batch.y.clone()
        backend.shrink_expand(y, batch.x, w, meta)
        torch.testing.assert_close(y.cpu().double(), expected, **TOLERANCES[torch.float32], msg=backend.name)
