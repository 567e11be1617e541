"""Attention over the paged KV cache with torch scaled_dot_product_attention.

Each step writes the new tokens' K/V into their cache slots, then gathers every request's pages of keys (cached + new)
into a padded (reqs, max_kv_pages * page_size) block and runs one SDPA call per group. Requests are grouped by kind,
at most two groups: decodes (one new token) and prefills, so a long prompt in the batch does not pad every decode to
its length.

With the CPU kernels (the `cpu` backend: bfloat16 on a CPU with AVX-512 BF16), a group of decodes goes to cpu_ext's
decode_attention instead, which reads each request's keys and values straight from its pages: no gathered copy, no
padding, no mask. The caller passes that module (`decode_kernels`) when its head shapes are ones the kernel takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionGroup:
    token_rows: torch.Tensor  # (group_tokens,) rows of the batch's flat token dimension in this group
    query_index: torch.Tensor  # (group_tokens,) each token's row in the padded (reqs * max_q_len) query layout
    read_pages: torch.Tensor  # (reqs, max_kv_pages) each request's page table; padding points at page 0
    kv_lens: torch.Tensor  # (reqs,) int64 keys each request attends to: its cached tokens and its new ones
    mask: torch.Tensor  # (reqs, 1, max_q_len, max_kv_len) bool, True = may attend (causal, within the request)
    num_reqs: int
    max_q_len: int
    page_size: int


@dataclass(frozen=True)
class AttentionInputs:
    write_slots: torch.Tensor  # (tokens,) cache slot each new token's K/V goes to
    groups: list[AttentionGroup]


def paged_attention(
    q: torch.Tensor,  # (tokens, heads, head_dim)
    k: torch.Tensor,  # (tokens, kv_heads, head_dim)
    v: torch.Tensor,  # (tokens, kv_heads, head_dim)
    k_cache: torch.Tensor,  # (slots, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (slots, kv_heads, head_dim)
    inputs: AttentionInputs,
    decode_kernels: ModuleType | None = None,  # cpu_ext's module, for these head shapes, or None
) -> torch.Tensor:
    k_cache.index_copy_(0, inputs.write_slots, k)
    v_cache.index_copy_(0, inputs.write_slots, v)
    if not k_cache.is_contiguous():
        decode_kernels = None
    if len(inputs.groups) == 1:
        return _attend_group(q, k_cache, v_cache, inputs.groups[0], decode_kernels)
    out = torch.empty_like(q)  # (tokens, heads, head_dim)
    for group in inputs.groups:
        group_out = _attend_group(q.index_select(0, group.token_rows), k_cache, v_cache, group, decode_kernels)
        out.index_copy_(0, group.token_rows, group_out)
    return out


def _attend_group(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: AttentionGroup,
    decode_kernels: ModuleType | None,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    if group.max_q_len == 1 and decode_kernels is not None:
        out = torch.empty_like(q)  # (reqs, heads, head_dim): one token per request, in request order
        decode_kernels.decode_attention(
            q.contiguous(), k_cache, v_cache, group.read_pages, group.kv_lens, group.page_size, head_dim**-0.5, out
        )
        return out
    num_reqs, max_q_len = group.num_reqs, group.max_q_len
    q_padded = q.new_zeros(num_reqs * max_q_len, num_heads, head_dim)
    q_padded.index_copy_(0, group.query_index, q)
    q_padded = q_padded.view(num_reqs, max_q_len, num_heads, head_dim).transpose(1, 2)  # (reqs, heads, q, d)
    keys = _gather_pages(k_cache, group.read_pages, group.page_size)  # (reqs, kv_heads, max_kv_len, head_dim)
    values = _gather_pages(v_cache, group.read_pages, group.page_size)  # (reqs, kv_heads, max_kv_len, head_dim)
    out = F.scaled_dot_product_attention(
        q_padded, keys, values, attn_mask=group.mask, enable_gqa=keys.shape[1] != num_heads
    )  # (reqs, heads, max_q_len, head_dim)
    out = out.transpose(1, 2).reshape(num_reqs * max_q_len, num_heads, head_dim)
    return out.index_select(0, group.query_index)  # (tokens, heads, head_dim)


def _gather_pages(cache: torch.Tensor, read_pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """(slots, kv_heads, head_dim) cache, (reqs, pages) page tables -> (reqs, kv_heads, pages * page_size, head_dim):
    one row copy per page (index_select over whole pages is ~3x faster on CPU than indexing per token position)."""
    num_slots, num_kv_heads, head_dim = cache.shape
    num_reqs, num_pages = read_pages.shape
    pages = cache.view(num_slots // page_size, -1).index_select(0, read_pages.view(-1))  # (reqs * pages, page elems)
    return pages.view(num_reqs, num_pages * page_size, num_kv_heads, head_dim).transpose(1, 2)

