"""Attention over the paged KV cache with torch scaled_dot_product_attention.

Each step writes the new tokens' K/V into their cache slots, then gathers every request's pages of keys (cached + new)
into a padded (reqs, max_kv_pages * page_size) block and runs one SDPA call per group. Requests are grouped by kind,
at most two groups: decodes (one new token) and prefills, so a long prompt in the batch does not pad every decode to
its length.

That is the `torch` attention backend. The `cpu` one (bfloat16 on a CPU where the compiled CPU kernels run, for head
shapes they take) is the same but for the group of decodes, which goes to cpu_ext's decode_attention: it reads each
request's keys and values straight from its pages, no gathered copy, no padding, no mask. The `triton` one
(worker/layers/triton_attention.py; CUDA by default) reads every request's keys and values from its pages in Triton
kernels. The worker picks one at start-up (`select_attention_backend`); it builds each batch's AttentionInputs-like
object, whose `attend` the model reaches through `paged_attention`, so model code never knows which backend runs.

A layer's own attention (softmax scale, sliding window, logit soft-cap: worker/layers/attention_spec.py) comes with
each call; the batch's metadata is shared by every layer. Soft-capped scores and attention sinks run eager attention
here (SDPA has neither); the `cpu` backend sends such layers' decodes there too; the `triton` kernels take both.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Protocol

import torch
import torch.nn.functional as F
from loraplex.kernels import BackendError
from loraplex.protocol.mathutil import cdiv
from loraplex.protocol.structs import ForwardReq
from loraplex.worker.layers.attention_spec import LayerAttention
from loraplex.worker.layers.triton_attention import TritonAttention

ATTENTION_BACKENDS = ("auto", "triton", "cpu", "torch")


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
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # by window, built on a layer's first use

    def mask_for(self, window: int | None) -> torch.Tensor:
        if window is None:
            return self.mask
        mask = self.window_masks.get(window)
        if mask is None:
            mask = self.window_masks[window] = self.mask & (self.distance < window)
        return mask


@dataclass(frozen=True)
class AttentionInputs:
    write_slots: torch.Tensor  # (tokens,) cache slot each new token's K/V goes to
    groups: list[AttentionGroup]

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: LayerAttention | None = None
    ) -> torch.Tensor:
        layer = layer or LayerAttention.default(q.shape[2])
        if len(self.groups) == 1:
            return self.attend_group(q, k_cache, v_cache, self.groups[0], layer)
        out = torch.empty_like(q)  # (tokens, heads, head_dim)
        for group in self.groups:
            group_out = self.attend_group(q.index_select(0, group.token_rows), k_cache, v_cache, group, layer)
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
        # The kernel reads decodes from whole pages, without a logit cap or sinks.
        if group.max_q_len > 1 or not k_cache.is_contiguous() or layer.logit_cap is not None or layer.sinks is not None:
            return _sdpa_group(q, k_cache, v_cache, group, layer)
        out = torch.empty_like(q)  # (reqs, heads, head_dim): one token per request, in request order
        window = layer.sliding_window or 0  # 0: every key
        self.compiled.decode_attention(
            q.contiguous(), k_cache, v_cache, group.read_pages, group.kv_lens, group.page_size, layer.scale, window,
            out,
        )  # fmt: skip
        return out


class BatchAttention(Protocol):
    """One batch's attention metadata, as a backend built it."""

    write_slots: torch.Tensor  # (tokens,) cache slot each new token's K/V goes to

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: LayerAttention | None = None
    ) -> torch.Tensor:
        """`layer` None: head_dim ** -0.5, no window, no cap."""
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

    def warmup(self, kv_layer: tuple[torch.Tensor, torch.Tensor], num_heads: int, page_size: int) -> int:
        """Compile what the backend compiles on first use, for every variant serving can meet; the launches made."""
        ...


class SDPAAttention:
    """torch's scaled_dot_product_attention over gathered pages."""

    name = "torch"

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
            _build_group(reqs, members, token_starts, page_tables, page_size, self.device)
            for members in (decodes, prefills)
            if members
        ]
        return AttentionInputs(write_slots=write_slots, groups=groups)

    def warmup(self, kv_layer: tuple[torch.Tensor, torch.Tensor], num_heads: int, page_size: int) -> int:
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


def select_attention_backend(
    choice: str,
    device: torch.device | str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cpu_kernels: ModuleType | None = None,
    *,
    values_in_keys: bool = False,
    sinks: bool = False,
) -> AttentionBackend:
    """The attention backend for this worker (`--attention-backend`), or AttentionBackendError (one line).
    Heads: this rank's. `cpu_kernels`: the compiled CPU module the worker's LoRA backend built (cpu_ext), or None.
    `values_in_keys`: latent attention, whose one cache tensor is keys and values both (its values the leading
    part of each key); SDPA takes it as any other, the paged kernels are not built for it. `sinks`: the model's
    layers have attention sinks (the Triton kernels' sinks variant is warmed up; the CPU kernel has none, so those
    layers' decodes run the torch path)."""
    device = torch.device(device)
    if choice not in ATTENTION_BACKENDS:
        raise AttentionBackendError(f"--attention-backend {choice!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    if values_in_keys:
        if choice not in ("auto", "torch"):
            raise AttentionBackendError(f"--attention-backend {choice}: latent attention runs the torch backend")
        return SDPAAttention(device)
    cpu_runs = device.type == "cpu" and cpu_kernels is not None
    if choice == "cpu" and not cpu_runs:
        raise AttentionBackendError(
            f"--attention-backend cpu needs the compiled CPU kernels (bfloat16 on a CPU, --lora-backend cpu or auto); "
            f"this worker runs on {device} without them"
        )
    cpu_takes_shapes = cpu_runs and cpu_kernels.decode_attention_supports(num_heads // num_kv_heads, head_dim)
    if choice == "cpu" and not cpu_takes_shapes:
        raise AttentionBackendError(
            f"--attention-backend cpu: the CPU decode kernel does not take {num_heads // num_kv_heads} query heads "
            f"per KV head of {head_dim} dims"
        )
    if choice == "cpu" or (choice == "auto" and cpu_takes_shapes):
        return CPUAttention(device, cpu_kernels)
    if choice == "torch" or (choice == "auto" and device.type != "cuda"):
        return SDPAAttention(device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise AttentionBackendError(f"--attention-backend triton needs a CUDA device; this worker runs on {device}")
    return TritonAttention(device, num_kv_heads, sinks=sinks)


def paged_attention(
    q: torch.Tensor,  # (tokens, heads, head_dim)
    k: torch.Tensor,  # (tokens, kv_heads, head_dim)
    v: torch.Tensor,  # (tokens, kv_heads, head_dim)
    k_cache: torch.Tensor,  # (slots, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (slots, kv_heads, head_dim)
    inputs: BatchAttention,
    layer: LayerAttention | None = None,  # None: head_dim ** -0.5, no window, no cap
) -> torch.Tensor:
    k_cache.index_copy_(0, inputs.write_slots, k)
    v_cache.index_copy_(0, inputs.write_slots, v)
    return inputs.attend(q, k_cache, v_cache, layer)  # (tokens, heads, head_dim)


def _sdpa_group(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: AttentionGroup, layer: LayerAttention
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_reqs, max_q_len = group.num_reqs, group.max_q_len
    q_padded = q.new_zeros(num_reqs * max_q_len, num_heads, head_dim)
    q_padded.index_copy_(0, group.query_index, q)
    q_padded = q_padded.view(num_reqs, max_q_len, num_heads, head_dim).transpose(1, 2)  # (reqs, heads, q, d)
    keys = _gather_pages(k_cache, group.read_pages, group.page_size)  # (reqs, kv_heads, max_kv_len, head_dim)
    values = _gather_pages(v_cache, group.read_pages, group.page_size)  # (reqs, kv_heads, max_kv_len, head_dim)
    mask = group.mask_for(layer.sliding_window)
    if layer.logit_cap is None and layer.sinks is None:
        out = F.scaled_dot_product_attention(
            q_padded, keys, values, attn_mask=mask, scale=layer.scale, enable_gqa=keys.shape[1] != num_heads
        )  # (reqs, heads, max_q_len, head_dim)
    else:
        out = _eager_attention(q_padded, keys, values, mask, layer)
    out = out.transpose(1, 2).reshape(num_reqs * max_q_len, num_heads, head_dim)
    return out.index_select(0, group.query_index)  # (tokens, heads, head_dim)


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
    """(slots, kv_heads, head_dim) cache, (reqs, pages) page tables -> (reqs, kv_heads, pages * page_size, head_dim):
    one row copy per page (index_select over whole pages is ~3x faster on CPU than indexing per token position)."""
    num_slots, num_kv_heads, head_dim = cache.shape
    num_reqs, num_pages = read_pages.shape
    pages = cache.view(num_slots // page_size, -1).index_select(0, read_pages.view(-1))  # (reqs * pages, page elems)
    return pages.view(num_reqs, num_pages * page_size, num_kv_heads, head_dim).transpose(1, 2)


def _build_group(
    reqs: list[ForwardReq],
    members: list[int],
    token_starts: list[int],
    page_tables: torch.Tensor,
    page_size: int,
    device: torch.device,
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
    # A padding row counts distances from the request's last key, so a window leaves it at least that key.
    distance = torch.minimum(q_pos, total - 1) - kv_pos[None, None, :]  # (reqs, max_q_len, max_kv_len)
    return AttentionGroup(
        token_rows=torch.tensor(token_rows, device=device),
        query_index=torch.tensor(query_index, device=device),
        read_pages=read_pages,
        kv_lens=total.view(-1),
        mask=mask.unsqueeze(1),
        distance=distance.unsqueeze(1),
        num_reqs=len(members),
        max_q_len=max_q_len,
        page_size=page_size,
    )
