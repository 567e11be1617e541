"""Torch references the kernels are checked against, with the kernels' own signatures (no tests here): the LoRA
shrink/expand of the torch path from tensors alone (through the compiled CPU kernels for bfloat16 CPU tensors where they
are built, as the `cpu` backend runs), the Triton backend's shrink_expand from tensors alone, paged attention (plain
and latent) in float32, the model's fused ops (RMSNorm with its residual add, rotary embedding, SiLU-and-multiply) as
the torch ops compute them, and Gated DeltaNet's conv and delta rule as its torch mixer computes them. The worker never
calls these: it runs its backend objects (kernels/backend.py, worker/layers/attention.py, worker/layers/ops.py,
worker/layers/delta_mixer.py)."""

from __future__ import annotations

from types import ModuleType

import torch
from loraplex.kernels import cpu_ext, lora_torch
from loraplex.kernels.checks import check_expand_args, check_shrink_args
from loraplex.kernels.gated_delta import check_conv_args, check_delta_rule_args
from loraplex.kernels.latent_attention import check_latent_decode_args, check_latent_extend_args
from loraplex.kernels.lora_expand import column_alignment, launch_expand
from loraplex.kernels.lora_shrink import launch_shrink, shrink_output
from loraplex.kernels.lora_torch import expand_planned, shrink_expand_compiled, shrink_planned
from loraplex.kernels.mxfp4_matmul import check_mxfp4_matmul_args
from loraplex.kernels.paged_attention import check_decode_args, check_extend_args
from loraplex.kernels.quant_matmul import check_fp8_matmul_args, check_int_matmul_args
from loraplex.kernels.rms_norm import check_rms_norm_args
from loraplex.kernels.rotary import check_rotary_args
from loraplex.kernels.segment_tiles import plan_tiles
from loraplex.kernels.silu_mul import check_silu_and_mul_args
from loraplex.worker.layers.delta_mixer import TorchDeltaMixer
from loraplex.worker.layers.ops import TorchOps
from loraplex.worker.quant import mxfp4
from loraplex.worker.state_cache import StateBatch

# ---- LoRA, torch path -----------------------------------------------------------------------------------------------


def _compiled_for(t: torch.Tensor) -> ModuleType | None:
    """The compiled CPU kernels if they take this tensor (bfloat16, on the CPU) and could be built here, else None."""
    return cpu_ext.kernels() if t.dtype == torch.bfloat16 and t.device.type == "cpu" else None


def _plan(seg_indptr: torch.Tensor, seg_slots: torch.Tensor, compiled: bool = False) -> lora_torch._Plan:
    return lora_torch.make_plan(seg_indptr.tolist(), seg_slots.tolist(), seg_indptr.device, compiled)


def lora_shrink_torch(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    num_slices: int,
) -> torch.Tensor:
    check_shrink_args(x, lora_a, seg_indptr, seg_slots, slot_ranks, num_slices)
    compiled = _compiled_for(x)
    return shrink_planned(x, lora_a, slot_ranks, num_slices, _plan(seg_indptr, seg_slots, compiled is not None),
                          None, compiled)  # fmt: skip


def lora_expand_torch(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scales: torch.Tensor,
    slice_offsets: torch.Tensor,
    row_scales: torch.Tensor | None = None,
) -> None:
    check_expand_args(y, h, lora_b, seg_indptr, seg_slots, slot_ranks, slot_scales, slice_offsets, row_scales)
    if row_scales is not None:
        h = h * row_scales.to(h.dtype)[:, None]
    compiled = _compiled_for(y)
    plan = _plan(seg_indptr, seg_slots, compiled is not None)
    expand_planned(y, h, lora_b, slot_ranks, slot_scales, slice_offsets.tolist(), plan, None, None, compiled)


def lora_shrink_expand_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scales: torch.Tensor,
    slice_offsets: torch.Tensor,
    row_scales: torch.Tensor | None = None,
) -> None:
    """y += each row's expand of its shrink (times its row scale). With the compiled kernels and no row scales, the
    short segments' rows take one call for both (which checks its arguments itself) and each long segment its own
    matmuls; otherwise shrink then expand."""
    compiled = _compiled_for(x)
    if compiled is None or y.dtype != x.dtype or row_scales is not None:
        h = lora_shrink_torch(x, lora_a, seg_indptr, seg_slots, slot_ranks, slice_offsets.shape[0] - 1)
        lora_expand_torch(y, h, lora_b, seg_indptr, seg_slots, slot_ranks, slot_scales, slice_offsets, row_scales)
        return
    plan = _plan(seg_indptr, seg_slots, compiled=True)
    shrink_expand_compiled(y, x, lora_a, lora_b, slot_ranks, slot_scales, slice_offsets, None, plan, None, None,
                           compiled)  # fmt: skip


# ---- LoRA, Triton ---------------------------------------------------------------------------------------------------


def lora_shrink_expand_triton(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    slot_ranks: torch.Tensor,
    slot_scales: torch.Tensor,
    slice_offsets: torch.Tensor,
    row_scales: torch.Tensor | None = None,
) -> None:
    """y += the expand of the shrink, as the Triton backend runs it: two launches, no fill, split-K planes summed by the
    expand (checked and planned from the tensors here: host reads the backend does not make)."""
    num_slices = slice_offsets.shape[0] - 1
    check_shrink_args(x, lora_a, seg_indptr, seg_slots, slot_ranks, num_slices)
    h_splits = shrink_output(x, lora_a)
    check_expand_args(
        y, h_splits[0], lora_b, seg_indptr, seg_slots, slot_ranks, slot_scales, slice_offsets, row_scales,
        float32_h=True,
    )  # fmt: skip
    tiles = plan_tiles(x.shape[0], seg_slots.shape[0])
    launch_shrink(x, lora_a, h_splits, seg_indptr, seg_slots, slot_ranks, num_slices, tiles)
    launch_expand(y, h_splits, lora_b, seg_indptr, seg_slots, slot_ranks, slot_scales, slice_offsets, tiles,
                  column_alignment(slice_offsets.tolist()), row_scales)  # fmt: skip


# ---- paged attention ------------------------------------------------------------------------------------------------


def _attend_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: list[int], page_size: int,
                q_positions: torch.Tensor, scale: float, window: int, logit_cap: float,
                sinks: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:  # fmt: skip
    """q (n, heads, d) at q_positions (n,) over the keys 0..max position of one request (those past position - window
    when window > 0, those of the position's chunk when chunk > 0; scores soft-capped when logit_cap > 0; each head's
    sink logit one more softmax column, of no value), in fp32 -> (n, heads, d)."""
    num_keys = int(q_positions.max()) + 1
    positions = torch.arange(num_keys, device=q.device)
    page_ids = torch.tensor(pages, dtype=torch.long, device=q.device)
    slots = page_ids[positions // page_size] * page_size + positions % page_size
    group = q.shape[1] // k_cache.shape[1]
    keys = k_cache[slots].float().repeat_interleave(group, dim=1)  # (keys, heads, d)
    values = v_cache[slots].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale  # (heads, n, keys)
    if logit_cap > 0:
        scores = torch.tanh(scores / logit_cap) * logit_cap
    hidden = positions[None, None, :] > q_positions[None, :, None]
    if window > 0:
        hidden |= positions[None, None, :] <= q_positions[None, :, None] - window
    if chunk > 0:
        hidden |= positions[None, None, :] // chunk != q_positions[None, :, None] // chunk
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    sink_column = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)  # (heads, n, 1)
    probs = torch.cat([scores, sink_column], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, values)


def paged_decode_attention_torch(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 page_table: torch.Tensor, kv_lens: torch.Tensor, q_rows: torch.Tensor,
                                 page_size: int, scale: float, num_splits: int, window: int = 0,
                                 logit_cap: float = 0.0, sinks: torch.Tensor | None = None,
                                 chunk: int = 0) -> None:  # fmt: skip
    check_decode_args(out, q, k_cache, v_cache, page_table, kv_lens, q_rows, page_size, num_splits, sinks, chunk)
    for req, (kv_len, row) in enumerate(zip(kv_lens.tolist(), q_rows.tolist(), strict=True)):
        if kv_len == 0:
            out[row] = 0
            continue
        position = torch.tensor([kv_len - 1], device=q.device)
        out[row] = _attend_one(q[row : row + 1], k_cache, v_cache, page_table[req].tolist(), page_size, position,
                               scale, window, logit_cap, sinks, chunk)[0].to(out.dtype)  # fmt: skip


def paged_extend_attention_torch(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 page_table: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                                 cached_lens: torch.Tensor, tile_reqs: torch.Tensor, tile_offsets: torch.Tensor,
                                 page_size: int, scale: float, window: int = 0,
                                 logit_cap: float = 0.0, sinks: torch.Tensor | None = None,
                                 chunk: int = 0) -> None:  # fmt: skip
    check_extend_args(out, q, k_cache, v_cache, page_table, q_starts, q_lens, cached_lens, tile_reqs, tile_offsets,
                      page_size, sinks, chunk)  # fmt: skip
    for req, (start, q_len, cached) in enumerate(
        zip(q_starts.tolist(), q_lens.tolist(), cached_lens.tolist(), strict=True)
    ):
        if q_len == 0:
            continue
        positions = cached + torch.arange(q_len, device=q.device)
        out[start : start + q_len] = _attend_one(q[start : start + q_len], k_cache, v_cache, page_table[req].tolist(),
                                                 page_size, positions, scale, window, logit_cap,
                                                 sinks, chunk).to(out.dtype)  # fmt: skip


def _latent_attend_one(q: torch.Tensor, cache: torch.Tensor, pages: list[int], page_size: int,
                       q_positions: torch.Tensor, latent_dim: int, scale: float) -> torch.Tensor:  # fmt: skip
    """q (n, heads, latent + rope) at q_positions over one request's cache rows [c | k_pe] 0..max position, causal,
    in fp32 -> (n, heads, latent_dim): every head against the one KV head, the values each row's latent."""
    num_keys = int(q_positions.max()) + 1
    positions = torch.arange(num_keys, device=q.device)
    page_ids = torch.tensor(pages, dtype=torch.long, device=q.device)
    rows = cache[page_ids[positions // page_size] * page_size + positions % page_size, 0].float()  # (keys, d)
    scores = torch.einsum("qhd,kd->hqk", q.float(), rows) * scale  # (heads, n, keys)
    scores = scores.masked_fill(positions[None, None, :] > q_positions[None, :, None], float("-inf"))
    return torch.einsum("hqk,kc->qhc", scores.softmax(-1), rows[:, :latent_dim])


def paged_latent_decode_attention_torch(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor,
                                        page_table: torch.Tensor, kv_lens: torch.Tensor, q_rows: torch.Tensor,
                                        page_size: int, latent_dim: int, scale: float,
                                        num_splits: int) -> None:  # fmt: skip
    check_latent_decode_args(out, q, cache, page_table, kv_lens, q_rows, page_size, latent_dim, num_splits)
    for req, (kv_len, row) in enumerate(zip(kv_lens.tolist(), q_rows.tolist(), strict=True)):
        if kv_len == 0:
            out[row] = 0
            continue
        position = torch.tensor([kv_len - 1], device=q.device)
        out[row] = _latent_attend_one(q[row : row + 1], cache, page_table[req].tolist(), page_size, position,
                                      latent_dim, scale)[0].to(out.dtype)  # fmt: skip


def paged_latent_extend_attention_torch(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor,
                                        page_table: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                                        cached_lens: torch.Tensor, tile_reqs: torch.Tensor,
                                        tile_offsets: torch.Tensor, page_size: int, latent_dim: int,
                                        scale: float) -> None:  # fmt: skip
    check_latent_extend_args(out, q, cache, page_table, q_starts, q_lens, cached_lens, tile_reqs, tile_offsets,
                             page_size, latent_dim)  # fmt: skip
    for req, (start, q_len, cached) in enumerate(
        zip(q_starts.tolist(), q_lens.tolist(), cached_lens.tolist(), strict=True)
    ):
        if q_len == 0:
            continue
        positions = cached + torch.arange(q_len, device=q.device)
        out[start : start + q_len] = _latent_attend_one(q[start : start + q_len], cache, page_table[req].tolist(),
                                                        page_size, positions, latent_dim,
                                                        scale).to(out.dtype)  # fmt: skip


# ---- the model's fused ops: the torch ops the model runs without them (worker/layers/ops.py) -------------------------


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    check_rms_norm_args(x, weight)
    return TorchOps().rms_norm(x, weight, eps)


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_rms_norm_args(x, weight, residual)
    return TorchOps().add_rms_norm(x, residual, weight, eps)


def rotary_embedding_torch(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, as the kernel: q and k hold the rotated values, and are returned."""
    check_rotary_args(positions, q, k, cos, sin)
    q_out, k_out = TorchOps().rotary_embedding(positions, q, k, cos, sin)
    return q.copy_(q_out), k.copy_(k_out)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    check_silu_and_mul_args(gate_up)
    return TorchOps().silu_and_mul(gate_up)


# ---- weight-only quantized matmul ---------------------------------------------------------------------------------


def int_weight_matmul_torch(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, bits: int
) -> torch.Tensor:
    check_int_matmul_args(x, q, scales, zeros, group_size, bits)
    u = torch.stack([q & 0xF, q >> 4], dim=-1).flatten(1) if bits == 4 else q  # (out, in)
    groups = torch.arange(u.shape[1], device=u.device) // group_size
    w = (u.float() - zeros[:, groups]) * scales[:, groups]
    return (x.float() @ w.t()).to(x.dtype)


def fp8_weight_matmul_torch(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, row_ids: torch.Tensor, col_ids: torch.Tensor
) -> torch.Tensor:
    check_fp8_matmul_args(x, q, scales, row_ids, col_ids)
    w = q.float() * scales[row_ids][:, col_ids]
    return (x.float() @ w.t()).to(x.dtype)


def mxfp4_weight_matmul_torch(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                              out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x · Wᵀ on the weight the CPU path dequantizes (worker/quant/mxfp4.py), in x's dtype, as ExpertsLinear runs it
    there."""
    check_mxfp4_matmul_args(x, blocks, scales, out)
    y = x @ mxfp4.dequantize(blocks, scales, x.dtype).t()
    return y if out is None else out.copy_(y)


# ---- Gated DeltaNet: the torch mixer the layer runs without the kernels (worker/layers/delta_mixer.py) --------------


def _state_batch(table: torch.Tensor) -> StateBatch:
    starts, num_new, slots = table.tolist()
    if starts != [sum(num_new[:i]) for i in range(len(num_new))]:
        raise ValueError("the torch mixer takes requests laid one after the other from row 0")
    return StateBatch.of(slots, num_new, table.device)


def causal_conv_torch(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                      table: torch.Tensor) -> torch.Tensor:  # fmt: skip
    check_conv_args(x, conv_states, weight)
    return TorchDeltaMixer().conv(x, conv_states, weight, _state_batch(table))


def causal_conv_decode_torch(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                             slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    check_conv_args(x, conv_states, weight)
    return TorchDeltaMixer().conv(x, conv_states, weight, StateBatch.of(slots.tolist(), [1] * len(slots), x.device))


def delta_rule_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, table: torch.Tensor) -> torch.Tensor:  # fmt: skip
    check_delta_rule_args(q, k, v, g, beta, state)
    return TorchDeltaMixer().rule(q, k, v, g, beta, state, _state_batch(table))


def delta_rule_decode_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    check_delta_rule_args(q, k, v, g, beta, state)
    batch = StateBatch.of(slots.tolist(), [1] * len(slots), v.device)
    return TorchDeltaMixer().rule(q, k, v, g, beta, state, batch)
