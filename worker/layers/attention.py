"""Attention over the paged KV cache with torch scaled_dot_product_attention.

Each step writes the new tokens' K/V into their cache slots, then gathers every request's pages of keys (cached + new)
into a padded (reqs, max_kv_pages * page_size) block and runs one SDPA call per group. Requests are grouped by kind,
at most two groups: decodes (one new token) and prefills, so a long prompt in the batch does not pad every decode to
its length.

That is the `torch` attention backend. The `cpu` one (bfloat16 on a CPU where the compiled CPU kernels run, for head
shapes they take) is the same but for the group of decodes, which goes to cpu_ext's decode_attention: it reads each
request's keys and values straight from its pages, no gathered copy, no padding, no mask (sliding windows, attention
chunks and sinks included; an FP8 cache converted in registers, decode_attention_fp8). The torch path dequantizes an
FP8 cache's gathered pages to q's dtype. The `triton` one
(worker/layers/triton_attention.py; CUDA by default) reads every request's keys and values from its pages in Triton
kernels (latent attention's one tensor of [latent | rope key] rows with kernels of its own). The worker picks one at
start-up (`select_attention_backend`); it builds each batch's AttentionInputs-like object, whose `attend` the model
reaches through `paged_attention`, so model code never knows which backend runs.

A layer's own attention (softmax scale, sliding window, logit soft-cap: worker/layers/attention_spec.py) comes with
each call; the batch's metadata is shared by every layer. Soft-capped scores and attention sinks run eager attention
here (SDPA has neither); the `cpu` backend sends soft-capped layers' decodes there too; the `triton` kernels take
both.

Latent attention (worker/model/deepseek_v3.py) runs its decodes and its prefills in different forms, so the torch
backend's metadata also hands out its two groups as BatchParts (`decodes_and_prefills`): a part takes and places its
requests' rows of the batch, attends over the cache as `attend` does, or gathers its requests' whole context (cached
and new tokens, each padded to the group's longest in whole pages, as SDPA reads them) for the model to transform and
attend over (`gather_context`, `attend_context`). RowOwners say which request each of those rows serves, for
kv_b_proj's LoRA.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F
from loraplex.kernels import BackendError
from loraplex.kernels.latent_attention import latent_head_blocks, launch_latent_decode
from loraplex.kernels.paged_attention import decode_num_splits
from loraplex.protocol.mathutil import cdiv
from loraplex.protocol.structs import ForwardReq
from loraplex.worker.kv_cache import FP8_DTYPE, KVScales, dequantize_fp8, write_kv
from loraplex.worker.layers.attention_spec import LayerAttention
from loraplex.worker.layers.triton_attention import DecodeMeta, TritonAttention, _pack, _page_rows

ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")
_BIDIRECTIONAL = (-1, -1)  # AttentionGroup.local_masks' key of the mask of a non-causal layer
_NO_SINKS = torch.empty(0)  # the CPU decode kernel's sinks for a layer without them


class AttentionBackendError(BackendError):
    """An attention choice the device cannot run; the message is one line (the worker logs it as such)."""


@dataclass(frozen=True)
class AttentionGroup:
    token_rows: torch.Tensor  # (group_tokens,) rows of the batch's flat token dimension in this group
    query_index: torch.Tensor  # (group_tokens,) each token's row in the padded (reqs * max_q_len) query layout
    read_pages: torch.Tensor  # (reqs, max_kv_pages) each request's page table; padding points at page 0
    kv_lens: torch.Tensor  # (reqs,) int64 keys each request attends to: its cached tokens and its new ones
    mask: torch.Tensor  # (reqs, 1, max_q_len, max_kv_len) bool, True = may attend (causal, within the request)
    # (reqs, 1, max_q_len, max_kv_len) each key's distance behind its query row (padding rows: behind the last key)
    distance: torch.Tensor
    num_reqs: int
    max_q_len: int
    page_size: int
    first_rows: tuple[int, ...]  # (reqs,) host: each request's first row in the batch's flat token dimension
    q_lens: tuple[int, ...]  # (reqs,) host: each request's new tokens
    # (reqs, 1, max_q_len, 1) each query row's position (padding rows: the last key's), for chunked attention
    query_positions: torch.Tensor | None = None
    # by (window, chunk), built on a layer's first use
    local_masks: dict[tuple[int | None, int | None], torch.Tensor] = field(default_factory=dict)

    def mask_for(self, layer: LayerAttention) -> torch.Tensor:
        if not layer.is_causal:  # every key of the request: (reqs, 1, 1, max_kv_len), broadcast over query rows
            mask = self.local_masks.get(_BIDIRECTIONAL)
            if mask is None:
                kv_pos = torch.arange(self.max_kv_len, device=self.kv_lens.device)
                mask = self.local_masks[_BIDIRECTIONAL] = (kv_pos[None, :] < self.kv_lens[:, None])[:, None, None, :]
            return mask
        if layer.sliding_window is None and layer.chunk_size is None:
            return self.mask
        key = (layer.sliding_window, layer.chunk_size)
        mask = self.local_masks.get(key)
        if mask is None:
            mask = self.mask
            if layer.sliding_window is not None:
                mask = mask & (self.distance < layer.sliding_window)
            if layer.chunk_size is not None:  # the key at j = q - distance is in q's chunk: j // chunk == q // chunk
                chunk, q_pos = layer.chunk_size, self.query_positions
                mask = mask & (torch.div(q_pos - self.distance, chunk, rounding_mode="floor") == q_pos // chunk)
            self.local_masks[key] = mask
        return mask

    @property
    def max_kv_len(self) -> int:
        return self.mask.shape[-1]


@dataclass(frozen=True)
class RowOwners:
    """Which request each row of a tensor derived from the batch belongs to, in runs: rows [run_starts[i],
    run_starts[i + 1]) belong to the request whose new tokens start at batch row owner_rows[i]; runs in batch order.
    A LoRA wrapper reads each row's adapter through it (worker/lora/latent.py) and keeps what it derives from it, once
    per forward, in `extras`."""

    run_starts: tuple[int, ...]  # (runs + 1,)
    owner_rows: tuple[int, ...]  # (runs,)
    extras: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class BatchPart:
    """One group of the batch's requests, for a model that runs its decodes and its prefills apart (latent attention:
    the absorbed form for the one, the expanded form for the other): its tokens' rows, and attention over them
    either from the cache (`attend`) or over keys and values the model computed from the gathered context."""

    inputs: AttentionInputs
    group: AttentionGroup
    is_whole: bool  # the part is every request of the batch: its rows are the batch's, in order

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, ...) of the batch -> (part_tokens, ...) of this part's requests."""
        return x if self.is_whole else x.index_select(0, self.group.token_rows)

    def place(self, out: torch.Tensor, part_out: torch.Tensor) -> None:
        """Write (part_tokens, ...) into this part's rows of the batch's (tokens, ...) `out`."""
        if self.is_whole:
            out.copy_(part_out)
        else:
            out.index_copy_(0, self.group.token_rows, part_out)

    @cached_property
    def token_owners(self) -> RowOwners:
        """The owners of `take`'s rows: each request's new tokens."""
        return RowOwners(run_starts=_cumulative(self.group.q_lens), owner_rows=self.group.first_rows)

    @cached_property
    def context_owners(self) -> RowOwners:
        """The owners of `gather_context`'s rows: each request's max_kv_len of them."""
        group = self.group
        return RowOwners(run_starts=_cumulative([group.max_kv_len] * group.num_reqs), owner_rows=group.first_rows)

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: LayerAttention
    ) -> torch.Tensor:
        """q (part_tokens, heads, head_dim) over the cache, as the batch's `attend` -> (part_tokens, heads, d)."""
        return self.inputs.attend_group(q, k_cache, v_cache, self.group, layer)

    def gather_context(self, cache: torch.Tensor) -> torch.Tensor:
        """(slots, kv_heads, head_dim) cache -> (reqs * max_kv_len, kv_heads, head_dim): each request's cached and new
        tokens in position order, padded to max_kv_len (`attend_context` masks the padding)."""
        rows = _gather_rows(cache, self.group.read_pages, self.group.page_size)  # (reqs, max_kv_len, kv_heads, d)
        return rows.flatten(0, 1)

    def attend_context(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layer: LayerAttention
    ) -> torch.Tensor:
        """q (part_tokens, heads, head_dim) over keys (reqs * max_kv_len, heads, head_dim) and values (reqs *
        max_kv_len, heads, v_dim) laid out as `gather_context`, causal within each request -> (part_tokens, heads,
        v_dim)."""
        group = self.group
        keys = keys.view(group.num_reqs, group.max_kv_len, *keys.shape[1:]).transpose(1, 2)  # (reqs, heads, kv, d)
        values = values.view(group.num_reqs, group.max_kv_len, *values.shape[1:]).transpose(1, 2)
        return _sdpa_padded(q, keys, values, group, layer)


@dataclass(frozen=True)
class AttentionInputs:
    write_slots: torch.Tensor  # (tokens,) cache slot each new token's K/V goes to
    groups: list[AttentionGroup]

    def decodes_and_prefills(self) -> tuple[BatchPart | None, BatchPart | None]:
        return self._parts

    @cached_property
    def _parts(self) -> tuple[BatchPart | None, BatchPart | None]:
        # build() makes at most one group of each kind, decodes first
        parts: list[BatchPart | None] = [None, None]
        for group in self.groups:
            parts[1 if group.max_q_len > 1 else 0] = BatchPart(self, group, is_whole=len(self.groups) == 1)
        return parts[0], parts[1]

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: LayerAttention | None = None
    ) -> torch.Tensor:
        layer = layer or LayerAttention.default(q.shape[2])
        if len(self.groups) == 1:
            return self.attend_group(q, k_cache, v_cache, self.groups[0], layer)
        out = None  # (tokens, heads, the backend's output width: head_dim, or latent attention's latent dims)
        for group in self.groups:
            group_out = self.attend_group(q.index_select(0, group.token_rows), k_cache, v_cache, group, layer)
            if out is None:
                out = group_out.new_empty(q.shape[0], *group_out.shape[1:])
            out.index_copy_(0, group.token_rows, group_out)
        return out

    def attend_group(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: AttentionGroup,
        layer: LayerAttention,
    ) -> torch.Tensor:
        return _sdpa_group(q, k_cache, v_cache, group, layer)


@dataclass(frozen=True)
class CPUAttentionInputs(AttentionInputs):
    compiled: ModuleType  # cpu_ext's module

    def attend_group(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: AttentionGroup,
        layer: LayerAttention,
    ) -> torch.Tensor:
        # The kernel reads decodes from whole pages, without a logit cap.
        if group.max_q_len > 1 or not k_cache.is_contiguous() or layer.logit_cap is not None:
            return _sdpa_group(q, k_cache, v_cache, group, layer)
        out = torch.empty_like(q)  # (reqs, heads, head_dim): one token per request, in request order
        window, chunk = layer.sliding_window or 0, layer.chunk_size or 0  # 0: every key
        sinks = _NO_SINKS if layer.sinks is None else layer.sinks
        args = (q.contiguous(), k_cache, v_cache, group.read_pages, group.kv_lens, group.page_size, layer.scale,
                window, chunk, sinks)  # fmt: skip
        if layer.kv_scales is None:
            self.compiled.decode_attention(*args, out)
        else:  # an FP8 cache, converted in registers
            self.compiled.decode_attention_fp8(*args, layer.kv_scales, out)
        return out


@dataclass(frozen=True)
class LatentTritonInputs(AttentionInputs):
    """Latent attention's batch on the triton backend: the decodes through the paged latent decode kernel
    (kernels/latent_attention.py), prefills as AttentionInputs serve them (the model's expanded form gathers their
    context). Outputs over the cache are the latent dims only, (rows, heads, latent_dim)."""

    decode: DecodeMeta | None  # the decode group's requests in group order; q_rows are the group's own rows
    latent_dim: int
    page_size: int

    def attend_group(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: AttentionGroup,
        layer: LayerAttention,
    ) -> torch.Tensor:
        if group.max_q_len > 1:
            return _sdpa_group(q, k_cache, v_cache, group, layer)[..., : self.latent_dim]
        if layer.sliding_window is not None or layer.logit_cap is not None or layer.chunk_size is not None:
            raise ValueError("the latent decode kernel takes no sliding window, logit cap or attention chunks")
        out = q.new_empty(*q.shape[:2], self.latent_dim)  # (reqs, heads, latent_dim): one token per request
        d = self.decode
        launch_latent_decode(out, q, k_cache, d.page_table, d.kv_lens, d.q_rows, self.page_size, self.latent_dim,
                             layer.scale, d.num_splits)  # fmt: skip
        return out


class BatchAttention(Protocol):
    """One batch's attention metadata, as a backend built it."""

    write_slots: torch.Tensor  # (tokens,) cache slot each new token's K/V goes to

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: LayerAttention | None = None
    ) -> torch.Tensor:
        """-> (tokens, heads, head_dim); `layer` None: head_dim ** -0.5, no window, no cap. For latent attention
        (k_cache is v_cache) the torch backend returns whole heads and the triton backend only the values' leading
        latent dims (LatentTritonAttention): the model keeps those."""
        ...


class SplitBatchAttention(BatchAttention, Protocol):
    """A batch's attention that also hands its decodes and its prefills apart, for a model that runs them in different
    forms (latent attention: select_attention_backend gives it the torch backend, whose AttentionInputs do this)."""

    def decodes_and_prefills(self) -> tuple[BatchPart | None, BatchPart | None]:
        """The requests computing one new token, those computing several; None where the batch has none."""
        ...


class AttentionBackend(Protocol):
    name: str

    def build(
        self,
        reqs: Sequence[ForwardReq],
        token_starts: list[int],
        page_tables: torch.Tensor,
        write_slots: torch.Tensor,
        page_size: int,
    ) -> BatchAttention:
        """The batch's metadata: `token_starts` each request's first row in the flat token layout (host),
        `page_tables` (reqs, max_pages) int64 on the device, padded with page 0."""
        ...

    def warmup(self, kv_layer: tuple[torch.Tensor, torch.Tensor], num_heads: int, page_size: int,
               dtype: torch.dtype | None = None) -> int:
        """Compile what the backend compiles on first use, for every variant serving can meet; the launches made.
        dtype: the model's (default: the cache's, which an FP8 cache is not)."""
        ...


class SDPAAttention:
    """torch's scaled_dot_product_attention over gathered pages. `image_blocks` (set by the runner for a model whose
    image tokens attend both ways during prefill, Gemma 3): each image's placeholder run attends within itself in
    both directions on top of the causal mask (image_block_mask). Gemma 4's images (use_bidirectional_attention
    "vision") take another path, worker/image_blocks.py: only its sliding layers see a run both ways, and they attend
    the run's queries again over the cache after any backend's causal pass (its Triton kernels, strided views and
    KV-shared layers untouched); Gemma 3's runs are both ways on every layer, a mask here where the scores are made."""

    name = "torch"
    image_blocks = False

    def __init__(self, device: torch.device):
        self.device = device

    def build(
        self,
        reqs: Sequence[ForwardReq],
        token_starts: list[int],
        page_tables: torch.Tensor,
        write_slots: torch.Tensor,
        page_size: int,
    ) -> AttentionInputs:
        decodes = [i for i, req in enumerate(reqs) if len(req.input_ids) == 1]
        prefills = [i for i, req in enumerate(reqs) if len(req.input_ids) > 1]
        groups = [
            _build_group(reqs, members, token_starts, page_tables, page_size, self.device, self.image_blocks)
            for members in (decodes, prefills)
            if members
        ]
        return AttentionInputs(write_slots=write_slots, groups=groups)

    def warmup(self, kv_layer: tuple[torch.Tensor, torch.Tensor], num_heads: int, page_size: int,
               dtype: torch.dtype | None = None) -> int:
        return 0


class CPUAttention(SDPAAttention):
    """SDPA for prefills, the compiled CPU kernels' paged decode attention for the group of decodes."""

    name = "cpu"

    def __init__(self, device: torch.device, compiled: ModuleType):
        super().__init__(device)
        self.compiled = compiled

    def build(
        self,
        reqs: Sequence[ForwardReq],
        token_starts: list[int],
        page_tables: torch.Tensor,
        write_slots: torch.Tensor,
        page_size: int,
    ) -> CPUAttentionInputs:
        inputs = super().build(reqs, token_starts, page_tables, write_slots, page_size)
        return CPUAttentionInputs(write_slots=inputs.write_slots, groups=inputs.groups, compiled=self.compiled)


class LatentTritonAttention(SDPAAttention):
    """The `triton` backend for latent attention: SDPAAttention's groups, the decodes' paged latent decode kernel."""

    name = "triton"

    def __init__(self, device: torch.device, num_heads: int, latent_dim: int):
        super().__init__(device)
        self.latent_dim = latent_dim
        self.decode_programs = latent_head_blocks(num_heads)  # per request and split: the split count depends on it

    def build(
        self,
        reqs: Sequence[ForwardReq],
        token_starts: list[int],
        page_tables: torch.Tensor,
        write_slots: torch.Tensor,
        page_size: int,
    ) -> LatentTritonInputs:
        inputs = super().build(reqs, token_starts, page_tables, write_slots, page_size)
        decodes = [i for i, req in enumerate(reqs) if len(req.input_ids) == 1]
        decode = None
        if decodes:
            kv_lens = [reqs[i].num_cached_tokens + 1 for i in decodes]
            table, kv_lens_t, q_rows = _pack([_page_rows(reqs, decodes, page_size), kv_lens,
                                              list(range(len(decodes)))], self.device)  # fmt: skip
            splits = decode_num_splits(len(decodes), self.decode_programs, max(kv_lens))
            decode = DecodeMeta(table.view(len(decodes), -1), kv_lens_t, q_rows, splits)
        return LatentTritonInputs(write_slots=inputs.write_slots, groups=inputs.groups, decode=decode,
                                  latent_dim=self.latent_dim, page_size=page_size)  # fmt: skip

    @torch.inference_mode()
    def warmup(self, kv_layer: tuple[torch.Tensor, torch.Tensor], num_heads: int, page_size: int,
               dtype: torch.dtype | None = None) -> int:
        """The decode kernel without and with splits (and the merge), on one layer's cache (read only), q laid out as
        the model builds it ([W_ukᵀ q_nope | q_pe], contiguous): the variants of every later batch."""
        cache = kv_layer[0]
        q = cache.new_zeros(1, num_heads, cache.shape[2])  # (1 decode, heads, latent + rope)
        for num_splits in (1, 2):
            table, kv_lens, q_rows = _pack([[0], [1], [0]], self.device)
            decode = DecodeMeta(table.view(1, 1), kv_lens, q_rows, num_splits)
            out = q.new_empty(1, num_heads, self.latent_dim)
            launch_latent_decode(out, q, cache, decode.page_table, decode.kv_lens, decode.q_rows, page_size,
                                 self.latent_dim, 1.0, num_splits)  # fmt: skip
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return 3


def select_attention_backend(
    choice: str,
    device: torch.device | str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cpu_kernels: ModuleType | None = None,
    *,
    latent_dim: int | None = None,
    sinks: bool = False,
    mixed_head_shapes: bool = False,
    bidirectional: bool = False,
) -> AttentionBackend:
    """The attention backend for this worker (`--attention-backend`), or AttentionBackendError (one line).
    Heads: this rank's. `cpu_kernels`: the compiled CPU module the worker's LoRA backend built (cpu_ext), or None.
    `latent_dim`: latent attention, whose one cache tensor (one KV head of head_dim) is keys and values both, the
    values each key's leading latent_dim dims; SDPA takes it as any other, the triton backend as
    LatentTritonAttention (the latent decode kernel; its output only the latent dims), the CPU kernels not at all.
    `sinks`: the model's layers have attention sinks (the Triton kernels' sinks variant is warmed up).
    `mixed_head_shapes`: the layers' heads differ in width or KV heads (Gemma 4), where the CPU decode kernel, checked
    for one shape, is not used.
    `bidirectional`: an encoder's layers (LayerAttention.is_causal False), which SDPA masks; the Triton kernels are
    causal, so such a model runs the torch or cpu backend (auto picks one)."""
    device = torch.device(device)
    if choice not in ATTENTION_BACKENDS:
        raise AttentionBackendError(f"--attention-backend {choice!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    if bidirectional and choice == "triton":
        raise AttentionBackendError("--attention-backend triton: its kernels are causal; this bidirectional encoder "
                                    "runs the torch or cpu backend (or auto)")  # fmt: skip
    if latent_dim is not None and choice == "cpu":
        raise AttentionBackendError("--attention-backend cpu: latent attention runs the triton or torch backend")
    cpu_runs = device.type == "cpu" and cpu_kernels is not None and latent_dim is None
    if choice == "cpu" and not cpu_runs:
        raise AttentionBackendError(
            f"--attention-backend cpu needs the compiled CPU kernels (bfloat16 on a CPU, --lora-backend cpu or auto); "
            f"this worker runs on {device} without them"
        )
    if choice == "cpu" and mixed_head_shapes:
        raise AttentionBackendError(
            "--attention-backend cpu: the CPU decode kernel takes one head shape; this "
            "model's layers differ in head width or KV heads (choose torch or auto)"
        )
    cpu_takes_shapes = (cpu_runs and not mixed_head_shapes
                        and cpu_kernels.decode_attention_supports(num_heads // num_kv_heads, head_dim))  # fmt: skip
    if choice == "cpu" and not cpu_takes_shapes:
        raise AttentionBackendError(
            f"--attention-backend cpu: the CPU decode kernel does not take {num_heads // num_kv_heads} query heads "
            f"per KV head of {head_dim} dims"
        )
    if choice == "cpu" or (choice == "auto" and cpu_takes_shapes):
        return CPUAttention(device, cpu_kernels)
    if choice == "torch" or (choice == "auto" and (device.type != "cuda" or bidirectional)):
        return SDPAAttention(device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise AttentionBackendError(f"--attention-backend triton needs a CUDA device; this worker runs on {device}")
    if latent_dim is not None:
        return LatentTritonAttention(device, num_heads, latent_dim)
    return TritonAttention(device, num_kv_heads, sinks=sinks)


def paged_attention(
    q: torch.Tensor,  # (tokens, heads, head_dim)
    k: torch.Tensor,  # (tokens, kv_heads, head_dim)
    v: torch.Tensor,  # (tokens, kv_heads, head_dim)
    k_cache: torch.Tensor,  # (slots, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (slots, kv_heads, head_dim)
    inputs: BatchAttention,
    layer: LayerAttention | None = None,  # None: head_dim ** -0.5, no window, no cap
    scales: KVScales | None = None,  # an FP8 cache's (KVLayer.scales)
) -> torch.Tensor:
    write_kv(k, v, k_cache, v_cache, inputs.write_slots, scales)
    if scales is not None:  # the backends read the layer's scales beside its other settings
        layer = replace(layer or LayerAttention.default(q.shape[2]), kv_scales=scales.values)
    return inputs.attend(q, k_cache, v_cache, layer)  # (tokens, heads, head_dim)


def _sdpa_group(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup, layer: LayerAttention
) -> torch.Tensor:
    keys = _gather_pages(k_cache, group.read_pages, group.page_size)  # (reqs, kv_heads, max_kv_len, head_dim)
    values = _gather_pages(v_cache, group.read_pages, group.page_size)  # (reqs, kv_heads, max_kv_len, head_dim)
    if layer.kv_scales is not None:  # an FP8 cache: the gathered pages only, back to q's dtype
        keys = dequantize_fp8(keys, layer.kv_scales[0:1], q.dtype)
        values = dequantize_fp8(values, layer.kv_scales[1:2], q.dtype)
    return _sdpa_padded(q, keys, values, group, layer)


def _sdpa_padded(
    q: torch.Tensor,  # (tokens, heads, head_dim): the group's new tokens
    keys: torch.Tensor,  # (reqs, kv_heads, max_kv_len, head_dim)
    values: torch.Tensor,  # (reqs, kv_heads, max_kv_len, v_dim)
    group: AttentionGroup,
    layer: LayerAttention,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_reqs, max_q_len, v_dim = group.num_reqs, group.max_q_len, values.shape[-1]
    q_padded = q.new_zeros(num_reqs * max_q_len, num_heads, head_dim)
    q_padded.index_copy_(0, group.query_index, q)
    q_padded = q_padded.view(num_reqs, max_q_len, num_heads, head_dim).transpose(1, 2)  # (reqs, heads, q, d)
    mask = group.mask_for(layer)
    if layer.logit_cap is None and layer.sinks is None:
        out = F.scaled_dot_product_attention(
            q_padded, keys, values, attn_mask=mask, scale=layer.scale, enable_gqa=keys.shape[1] != num_heads
        )  # (reqs, heads, max_q_len, v_dim)
    else:
        out = _eager_attention(q_padded, keys, values, mask, layer)
    out = out.transpose(1, 2).reshape(num_reqs * max_q_len, num_heads, v_dim)
    return out.index_select(0, group.query_index)  # (tokens, heads, v_dim)


def _eager_attention(
    q: torch.Tensor,  # (reqs, heads, q, head_dim)
    keys: torch.Tensor,  # (reqs, kv_heads, kv, head_dim)
    values: torch.Tensor,  # (reqs, kv_heads, kv, head_dim)
    mask: torch.Tensor,  # (reqs, 1, q, kv) bool
    layer: LayerAttention,
) -> torch.Tensor:
    """Eager attention with soft-capped scores (rounded as HF's eager Gemma 2 attention rounds) and/or sinks: each
    head's sink logit is one more column of the softmax, dropped after it (its value is zero)."""
    group_size = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group_size, dim=1)  # (reqs, heads, kv, head_dim): query head h reads kv head h // g
    values = values.repeat_interleave(group_size, dim=1)
    scores = torch.matmul(q, keys.transpose(2, 3)) * layer.scale  # (reqs, heads, q, kv)
    if layer.logit_cap is not None:
        scores = torch.tanh(scores / layer.logit_cap) * layer.logit_cap
    scores = scores.masked_fill(~mask, float("-inf"))
    if layer.sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        num_reqs, num_heads, q_len, _ = scores.shape
        sinks = layer.sinks.to(scores.dtype).view(1, num_heads, 1, 1).expand(num_reqs, num_heads, q_len, 1)
        probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
    return torch.matmul(probs, values)  # (reqs, heads, q, head_dim)


def _gather_pages(cache: torch.Tensor, read_pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """(slots, kv_heads, head_dim) cache, (reqs, pages) page tables -> (reqs, kv_heads, pages * page_size, head_dim)."""
    return _gather_rows(cache, read_pages, page_size).transpose(1, 2)


def _gather_rows(cache: torch.Tensor, read_pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """(slots, kv_heads, head_dim) cache, (reqs, pages) page tables -> (reqs, pages * page_size, kv_heads, head_dim):
    one row copy per page (index_select over whole pages is ~3x faster on CPU than indexing per token position)."""
    if cache.dtype == FP8_DTYPE:  # as bytes: torch's CPU index ops take no float8
        return _gather_rows(cache.view(torch.uint8), read_pages, page_size).view(FP8_DTYPE)
    num_slots, num_kv_heads, head_dim = cache.shape
    num_reqs, num_pages = read_pages.shape
    if cache.is_contiguous():
        pages = cache.view(num_slots // page_size, -1)  # (all pages, page elems)
    else:  # a narrower layer's view of a wider cache (Gemma 4): each page's rows, strided
        pages = cache.unflatten(0, (num_slots // page_size, page_size))  # (all pages, page_size, kv_heads, d)
    pages = pages.index_select(0, read_pages.view(-1))  # (reqs * pages, ...)
    return pages.view(num_reqs, num_pages * page_size, num_kv_heads, head_dim)


def image_block_mask(reqs: Sequence[ForwardReq], q_pos: torch.Tensor, kv_pos: torch.Tensor, total: torch.Tensor
                     ) -> torch.Tensor:  # fmt: skip
    """(reqs, max_q_len, max_kv_len) True where a query and a key lie in one image's placeholder run (both ways, as
    HF's token_type_ids blocks: Gemma 3). The keys a sliding window drops stay dropped: the window's test is the
    query's distance behind the key, negative for a key ahead. The scheduler keeps such a run within one pass
    (WorkerReady.images_whole): a key ahead is a new token of this pass."""
    block = torch.zeros(len(reqs), q_pos.shape[1], kv_pos.shape[0], dtype=torch.bool, device=kv_pos.device)
    for n, req in enumerate(reqs):
        for image in req.images:
            lo, hi = image.offset, image.offset + image.num_tokens
            q_in = (q_pos[n, :, 0] >= lo) & (q_pos[n, :, 0] < hi)  # (max_q_len,)
            k_in = (kv_pos >= lo) & (kv_pos < hi) & (kv_pos < total[n, 0, 0])  # (max_kv_len,)
            block[n] |= q_in[:, None] & k_in[None, :]
    return block


def _cumulative(lengths: Sequence[int]) -> tuple[int, ...]:
    """(n,) lengths -> (n + 1,) offsets from 0."""
    return (0, *itertools.accumulate(lengths))


def _build_group(
    reqs: list[ForwardReq],
    members: list[int],
    token_starts: list[int],
    page_tables: torch.Tensor,
    page_size: int,
    device: torch.device,
    image_blocks: bool = False,
) -> AttentionGroup:
    q_lens = [len(reqs[i].input_ids) for i in members]
    cached_lens = [reqs[i].num_cached_tokens for i in members]
    max_q_len = max(q_lens)
    max_kv_pages = cdiv(max(c + q for c, q in zip(cached_lens, q_lens, strict=True)), page_size)
    max_kv_len = max_kv_pages * page_size  # keys are read a page at a time; the mask hides the tail

    token_rows = [token_starts[i] + j for i, q_len in zip(members, q_lens, strict=True) for j in range(q_len)]
    query_index = [n * max_q_len + j for n, q_len in enumerate(q_lens) for j in range(q_len)]

    kv_pos = torch.arange(max_kv_len, device=device)  # (max_kv_len,)
    member_ids = torch.tensor(members, device=device)
    read_pages = page_tables[member_ids, :max_kv_pages].contiguous()  # (reqs, max_kv_pages); a tail: page 0

    cached = torch.tensor(cached_lens, device=device)[:, None, None]  # (reqs, 1, 1)
    total = cached + torch.tensor(q_lens, device=device)[:, None, None]
    q_pos = cached + torch.arange(max_q_len, device=device)[None, :, None]  # (reqs, max_q_len, 1)
    # Padding query rows (beyond a request's new tokens) see all its keys, so no row is fully masked (NaN-free).
    mask = (kv_pos[None, None, :] <= q_pos) & (kv_pos[None, None, :] < total)  # (reqs, max_q_len, max_kv_len)
    if image_blocks and max_q_len > 1:
        mask = mask | image_block_mask([reqs[i] for i in members], q_pos, kv_pos, total)
    # A padding row counts distances from the request's last key, so a window leaves it at least that key.
    distance = torch.minimum(q_pos, total - 1) - kv_pos[None, None, :]  # (reqs, max_q_len, max_kv_len)
    return AttentionGroup(
        token_rows=torch.tensor(token_rows, device=device),
        query_index=torch.tensor(query_index, device=device),
        read_pages=read_pages,
        kv_lens=total.view(-1),
        mask=mask.unsqueeze(1),
        distance=distance.unsqueeze(1),
        query_positions=torch.minimum(q_pos, total - 1).unsqueeze(1),
        num_reqs=len(members),
        max_q_len=max_q_len,
        page_size=page_size,
        first_rows=tuple(token_starts[i] for i in members),
        q_lens=tuple(q_lens),
    )
