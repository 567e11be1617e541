"""The LoRA backend: one object, chosen once when a worker starts (`--lora-backend`), that does every LoRA product.

- `triton`: the Triton kernels (lora_shrink.py, lora_expand.py); CUDA, or any device under TRITON_INTERPRET=1 (tests).
- `cpu`: the compiled AVX-512 BF16 kernels of cpu_ext (built at start-up), bfloat16 on the CPU only; the worker hands
  the same module (`cpu_kernels`) to the `cpu` attention backend and the model's ops (worker/layers/ops.py) at start-up.
- `torch`: torch ops (lora_torch.py), on any device.
- `auto`: triton on CUDA; on the CPU, cpu where it runs (bfloat16, AVX-512 BF16, the build succeeds), else torch.

A choice the device cannot run raises BackendError with one line that says why; the worker fails to start on it.

Per forward pass, `prepare` turns the batch's segments (host lists) into a LoRABatchMeta: the segment tensors on the
device (one host-to-device copy) and the backend's plan (the torch path's row groups, the Triton row-tile sizes),
made once and shared by every LoRA linear of the pass. The ops then take that meta and one linear's pool weights
(LoRAWeights: the device buffers plus host copies of ranks, scales and slice bounds), so no op reads a tensor back to
the host or inspects one to decide what to run.
"""

from __future__ import annotations

import array
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch
import triton
from loraplex.kernels import cpu_ext, lora_torch
from loraplex.kernels.lora_expand import column_alignment, launch_expand
from loraplex.kernels.lora_shrink import launch_shrink, shrink_output, shrink_summed
from loraplex.kernels.progress import Progress
from loraplex.kernels.segment_tiles import plan_tiles

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "cpu", "torch")


class BackendError(RuntimeError):
    """A --lora-backend the device cannot run; the message is one line."""


class LoRAWeights(Protocol):
    """One fused linear's slots in one layer (worker/lora/pool.py: LoRABuffers)."""

    lora_a: torch.Tensor  # (slots, num_slices * max_rank, in_dim)
    lora_b: torch.Tensor  # (slots, max_rank, out_dim)
    slice_offsets: torch.Tensor  # (num_slices + 1,) int32
    row_offsets: tuple[int, ...]  # slice_offsets on the host
    slot_ranks: torch.Tensor  # (slots,) int32
    slot_scales: torch.Tensor  # (slots,) float32
    host_ranks: Sequence[int]  # slot_ranks on the host, kept in step by the pool
    host_scales: Sequence[float]  # slot_scales on the host

    @property
    def num_slices(self) -> int: ...


@dataclass(frozen=True)
class LoRABatchMeta:
    """One forward pass's segments: consecutive rows with one slot (-1 = base model, skipped)."""

    seg_indptr: torch.Tensor  # (segments + 1,) int32 on the device
    seg_slots: torch.Tensor  # (segments,) int32 on the device
    num_tokens: int
    plan: Any  # the backend's own: lora_torch's plan, or the Triton row-tile sizes
    # (tokens,) float32 on the device: each row's request strength (lora_scale), multiplied into its adapter's term
    # beside the slot's scaling; None: every row's is 1
    row_scales: torch.Tensor | None = None


class LoRABackend:
    """Shrink h = x·Aᵀ (per row, its slot's A), expand y += scale·h·Bᵀ, and both in one call where nothing runs
    between them. Subclasses set `name`, `plan` and the ops."""

    name = ""
    cpu_kernels: ModuleType | None = None  # the compiled CPU module, for attention and model ops (cpu only)

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def prepare(
        self, seg_indptr: list[int], seg_slots: list[int], row_scales: Sequence[float] | None = None
    ) -> LoRABatchMeta:
        """The batch's segment metadata on the device, and the backend's plan, once per forward pass; row_scales:
        each row's strength (None: all 1)."""
        num_segments = len(seg_slots)
        # One copy for every vector. seg_slots starts 16 bytes in (Triton specializes kernels on pointer alignment, so
        # an unaligned start would be a variant of its own); the row scales follow as float32 bit patterns.
        offset = triton.cdiv(num_segments + 1, 4) * 4
        values = seg_indptr + [0] * (offset - num_segments - 1) + seg_slots
        scales_at = triton.cdiv(len(values), 4) * 4
        if row_scales is not None:
            values += [0] * (scales_at - len(values)) + list(array.array("i", array.array("f", row_scales).tobytes()))
        packed = torch.tensor(values, dtype=torch.int32, device=self.device)
        return LoRABatchMeta(
            seg_indptr=packed[: num_segments + 1],
            seg_slots=packed[offset : offset + num_segments],
            num_tokens=seg_indptr[-1],
            plan=self.plan(seg_indptr, seg_slots),
            row_scales=None if row_scales is None else packed[scales_at:].view(torch.float32),
        )

    def plan(self, seg_indptr: list[int], seg_slots: list[int]) -> Any:
        raise NotImplementedError

    def shrink(self, x: torch.Tensor, w: LoRAWeights, meta: LoRABatchMeta) -> torch.Tensor:
        """(tokens, num_slices * max_rank) h; zero on base rows and past each row's rank."""
        raise NotImplementedError

    def expand(self, y: torch.Tensor, h: torch.Tensor, w: LoRAWeights, meta: LoRABatchMeta) -> None:
        raise NotImplementedError

    def shrink_expand(self, y: torch.Tensor, x: torch.Tensor, w: LoRAWeights, meta: LoRABatchMeta) -> None:
        self.expand(y, self.shrink(x, w, meta), w, meta)

    def warmup(self, weights: Sequence[LoRAWeights], max_segments: int, *, show_progress: bool = False) -> int:
        """Compile whatever the backend compiles on first use, for every shape the pool can meet; returns the number
        of launches made (0: nothing to compile). show_progress: report launches (a bar on a terminal, else logs)."""
        return 0


class TorchBackend(LoRABackend):
    name = "torch"
    compiled: ModuleType | None = None

    def plan(self, seg_indptr: list[int], seg_slots: list[int]) -> Any:
        return lora_torch.make_plan(seg_indptr, seg_slots, self.device, compiled=self.compiled is not None)

    def shrink(self, x: torch.Tensor, w: LoRAWeights, meta: LoRABatchMeta) -> torch.Tensor:
        return lora_torch.shrink_planned(
            x, w.lora_a, w.slot_ranks, w.num_slices, meta.plan, w.host_ranks, self.compiled
        )

    def expand(self, y: torch.Tensor, h: torch.Tensor, w: LoRAWeights, meta: LoRABatchMeta) -> None:
        if meta.row_scales is not None:
            h = h * meta.row_scales.to(h.dtype)[:, None]  # (tokens, num_slices * max_rank)
        lora_torch.expand_planned(
            y, h, w.lora_b, w.slot_ranks, w.slot_scales, w.row_offsets, meta.plan, w.host_ranks, w.host_scales,
            self.compiled,
        )  # fmt: skip


class CPUKernelsBackend(TorchBackend):
    """The compiled kernels for every row of a segment up to lora_torch.COMPILED_SEGMENT_ROWS long (shrink and expand
    in one call), torch matmuls for longer segments."""

    name = "cpu"

    def __init__(self, device: torch.device, compiled: ModuleType):
        super().__init__(device)
        self.compiled = self.cpu_kernels = compiled

    def shrink_expand(self, y: torch.Tensor, x: torch.Tensor, w: LoRAWeights, meta: LoRABatchMeta) -> None:
        if meta.row_scales is not None:  # the row scales go onto h between the compiled shrink and expand
            super().shrink_expand(y, x, w, meta)
            return
        lora_torch.shrink_expand_compiled(
            y, x, w.lora_a, w.lora_b, w.slot_ranks, w.slot_scales, w.slice_offsets, w.row_offsets, meta.plan,
            w.host_ranks, w.host_scales, self.compiled,
        )  # fmt: skip


class TritonBackend(LoRABackend):
    name = "triton"

    def plan(self, seg_indptr: list[int], seg_slots: list[int]) -> Any:
        return plan_tiles(seg_indptr[-1], len(seg_slots))

    def shrink(self, x: torch.Tensor, w: LoRAWeights, meta: LoRABatchMeta) -> torch.Tensor:
        return shrink_summed(x, w.lora_a, meta.seg_indptr, meta.seg_slots, w.slot_ranks, w.num_slices, meta.plan)

    def expand(self, y: torch.Tensor, h: torch.Tensor, w: LoRAWeights, meta: LoRABatchMeta) -> None:
        self._expand(y, h.unsqueeze(0), w, meta)

    def shrink_expand(self, y: torch.Tensor, x: torch.Tensor, w: LoRAWeights, meta: LoRABatchMeta) -> None:
        """Two launches: the shrink's split-K planes go uninitialized (no fill launch) and unsummed to the expand,
        which reads only what the shrink wrote and adds the planes up as it loads them."""
        h_splits = shrink_output(x, w.lora_a)  # (splits, tokens, num_slices * max_rank) float32
        launch_shrink(x, w.lora_a, h_splits, meta.seg_indptr, meta.seg_slots, w.slot_ranks, w.num_slices, meta.plan)
        self._expand(y, h_splits, w, meta)

    def _expand(self, y: torch.Tensor, h_splits: torch.Tensor, w: LoRAWeights, meta: LoRABatchMeta) -> None:
        launch_expand(
            y, h_splits, w.lora_b, meta.seg_indptr, meta.seg_slots, w.slot_ranks, w.slot_scales, w.slice_offsets,
            meta.plan, column_alignment(w.row_offsets), meta.row_scales,
        )  # fmt: skip

    @torch.inference_mode()
    def warmup(self, weights: Sequence[LoRAWeights], max_segments: int, *, show_progress: bool = False) -> int:
        """Launch both kernels once per variant Triton would otherwise compile during serving (warmup_batches), for
        each linear's pool weights, on batches of base rows only (every program exits at once)."""
        batches = warmup_batches(max_segments)
        max_tokens = max(tokens for tokens, _ in batches)
        launches = 0
        total = len(weights) * len(batches)
        with Progress(logger, "compiling the Triton LoRA kernels", total, "batches", enabled=show_progress) as progress:
            for w in weights:
                in_dim, out_dim = w.lora_a.shape[2], w.lora_b.shape[2]
                x_all = w.lora_a.new_zeros(max_tokens, in_dim)
                y_all = w.lora_b.new_zeros(max_tokens, out_dim)
                for num_tokens, num_segments in batches:
                    bounds = [num_tokens * i // num_segments for i in range(num_segments + 1)]
                    meta = self.prepare(bounds, [-1] * num_segments)
                    self.shrink_expand(y_all[:num_tokens], x_all[:num_tokens], w, meta)  # every LoRA linear's path
                    launches += 2
                    progress.update()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return launches


def warmup_batches(max_segments: int) -> list[tuple[int, int]]:
    """(tokens, segments) batches that together meet every compiled variant of the Triton LoRA kernels for up to
    `max_segments` segments. A variant is fixed by the constexprs BLOCK_M (16/32/64, from the mean segment length) and
    SEG_BLOCK (next power of two of the segments, at least 16), and by how Triton specializes the integer argument
    num_segments (== 1, a multiple of 16, or neither); the pool's other integers (dims, ranks, strides), pointers and
    column alignment are the same in every batch, and the split-K sizes (which follow the token count) are never
    specialized."""
    batches = []
    seg_block = 16
    while True:
        low, high = (1 if seg_block == 16 else seg_block // 2 + 1), min(seg_block, max_segments)
        if low > high:
            break
        counts = range(low, high + 1)
        kinds = (
            next((n for n in counts if n == 1), None),
            next((n for n in counts if n % 16 == 0), None),
            next((n for n in counts if n != 1 and n % 16), None),
        )
        for num_segments in (n for n in kinds if n is not None):
            # mean segment lengths of 1, 32 and 33 rows: BLOCK_M 16, 32 and 64
            batches += [(num_segments * mean, num_segments) for mean in (1, 32, 33)]
        seg_block *= 2
    return batches


def select_backend(choice: str, device: torch.device | str, dtype: torch.dtype) -> LoRABackend:
    """The backend for this worker, or BackendError (one line) if the device cannot run the choice."""
    device = torch.device(device)
    where = f"{str(dtype).removeprefix('torch.')} on {device}"
    if choice not in BACKENDS:
        raise BackendError(f"--lora-backend {choice!r}: choose one of {', '.join(BACKENDS)}")
    if choice == "auto":
        if device.type == "cuda":
            return TritonBackend(device)
        if device.type == "cpu" and dtype == torch.bfloat16 and cpu_ext.unavailable_reason() is None:
            compiled = cpu_ext.kernels()  # built now (~30 s the first time on a machine; logged)
            if compiled is not None:
                return CPUKernelsBackend(device, compiled)
        return TorchBackend(device)
    if choice == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise BackendError(f"--lora-backend triton needs a CUDA device; this worker runs {where}")
        return TritonBackend(device)
    if choice == "cpu":
        if device.type != "cpu" or dtype != torch.bfloat16:
            raise BackendError(f"--lora-backend cpu runs only bfloat16 on the CPU; this worker runs {where}")
        reason = cpu_ext.unavailable_reason()
        if reason is not None:
            raise BackendError(f"--lora-backend cpu: the CPU kernels cannot run here: {reason}")
        compiled = cpu_ext.kernels()
        if compiled is None:
            raise BackendError("--lora-backend cpu: the CPU kernels failed to build (the log above says why)")
        return CPUKernelsBackend(device, compiled)
    return TorchBackend(device)
