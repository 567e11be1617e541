"""The `triton` attention backend: paged decode and extend kernels (kernels/paged_attention.py) that read each
request's keys and values from its cache pages in place.

Per batch, `build` lays the requests' metadata out on the host and copies it to the device in one int32 tensor:
decodes (one new token) go to the decode kernel, the rest (prefill chunks, with or without a cached prefix) to the
extend kernel; both write their rows of one output, so nothing is gathered, padded or scattered back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from loraplex.kernels.paged_attention import decode_num_splits, launch_decode, launch_extend, plan_extend_tiles
from loraplex.protocol.mathutil import cdiv
from loraplex.protocol.structs import ForwardReq
from loraplex.worker.kv_cache import KVLayer
from loraplex.worker.layers.attention_spec import LayerAttention

_ALIGN = 4  # int32 elements: each packed part starts 16 bytes in, as Triton's pointer specialization expects


@dataclass(frozen=True)
class DecodeMeta:
    page_table: torch.Tensor  # (reqs, max_pages) int32; each row the request's pages, padded with page 0
    kv_lens: torch.Tensor  # (reqs,) int32 keys of each request, its new token included
    q_rows: torch.Tensor  # (reqs,) int32 each request's row in the flat token layout
    num_splits: int


@dataclass(frozen=True)
class ExtendMeta:
    page_table: torch.Tensor  # (reqs, max_pages) int32
    q_starts: torch.Tensor  # (reqs,) int32 first row of each request's new tokens
    q_lens: torch.Tensor  # (reqs,) int32
    cached_lens: torch.Tensor  # (reqs,) int32
    tile_reqs: torch.Tensor  # (tiles,) int32, from plan_extend_tiles
    tile_offsets: torch.Tensor  # (tiles,) int32


@dataclass(frozen=True)
class PagedAttentionInputs:
    write_slots: torch.Tensor  # (tokens,) cache slot each new token's K/V goes to
    page_size: int
    decode: DecodeMeta | None
    extend: ExtendMeta | None

    def attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: LayerAttention | None = None
    ) -> torch.Tensor:
        out = torch.empty_like(q)  # (tokens, heads, head_dim); every row is some request's
        layer = layer or LayerAttention.default(q.shape[2])
        window, cap, chunk = layer.sliding_window or 0, layer.logit_cap or 0.0, layer.chunk_size or 0  # 0: none
        if self.decode is not None:
            d = self.decode
            launch_decode(out, q, k_cache, v_cache, d.page_table, d.kv_lens, d.q_rows, self.page_size, layer.scale,
                          d.num_splits, window, cap, layer.sinks, chunk, layer.kv_scales)  # fmt: skip
        if self.extend is not None:
            e = self.extend
            launch_extend(out, q, k_cache, v_cache, e.page_table, e.q_starts, e.q_lens, e.cached_lens, e.tile_reqs,
                          e.tile_offsets, self.page_size, layer.scale, window, cap, layer.sinks, chunk,
                          layer.kv_scales)  # fmt: skip
        return out


class TritonAttention:
    name = "triton"

    def __init__(self, device: torch.device, num_kv_heads: int, sinks: bool = False):
        self.device = device
        self.num_kv_heads = num_kv_heads  # this rank's: the decode split count depends on it
        self.sinks = sinks  # the model's layers have attention sinks: their kernel variant is the one warmed up

    def build(
        self,
        reqs: Sequence[ForwardReq],
        token_starts: list[int],
        page_tables: torch.Tensor,
        write_slots: torch.Tensor,
        page_size: int,
    ) -> PagedAttentionInputs:
        decodes = [i for i, req in enumerate(reqs) if len(req.input_ids) == 1]
        extends = [i for i, req in enumerate(reqs) if len(req.input_ids) > 1]
        parts: list[list[int]] = []
        if decodes:
            kv_lens = [reqs[i].num_cached_tokens + 1 for i in decodes]
            parts += [_page_rows(reqs, decodes, page_size), kv_lens, [token_starts[i] for i in decodes]]
        if extends:
            q_lens = [len(reqs[i].input_ids) for i in extends]
            tile_reqs, tile_offsets = plan_extend_tiles(q_lens)
            parts += [
                _page_rows(reqs, extends, page_size),
                [token_starts[i] for i in extends],
                q_lens,
                [reqs[i].num_cached_tokens for i in extends],
                tile_reqs,
                tile_offsets,
            ]
        tensors = _pack(parts, self.device)
        decode = extend = None
        if decodes:
            table, kv_lens_t, q_rows = tensors[:3]
            tensors = tensors[3:]
            max_kv_len = max(reqs[i].num_cached_tokens for i in decodes) + 1
            splits = decode_num_splits(len(decodes), self.num_kv_heads, max_kv_len)
            decode = DecodeMeta(table.view(len(decodes), -1), kv_lens_t, q_rows, splits)
        if extends:
            table, *rest = tensors
            extend = ExtendMeta(table.view(len(extends), -1), *rest)
        return PagedAttentionInputs(write_slots=write_slots, page_size=page_size, decode=decode, extend=extend)

    @torch.inference_mode()
    def warmup(self, kv_layer: KVLayer, num_heads: int, page_size: int, dtype: torch.dtype | None = None) -> int:
        """Launch every kernel variant serving meets, on one layer's cache (read only): decode without and with splits
        (and the merge), and extend. Their constexprs depend only on the model, dtype and page size (and an FP8
        cache), and q is laid out as the model's (a view of the fused qkv output), so these are the variants of every
        later batch. dtype: the model's (default: the cache's)."""
        k_cache, v_cache = kv_layer
        head_dim, dtype = k_cache.shape[2], dtype or k_cache.dtype
        qkv = k_cache.new_zeros(2, (num_heads + 2 * self.num_kv_heads) * head_dim, dtype=dtype)
        q = qkv[:, : num_heads * head_dim].view(2, num_heads, head_dim)  # (tokens, heads, head_dim)
        no_writes = torch.empty(0, dtype=torch.long, device=self.device)  # attend reads the cache only
        layer = LayerAttention.default(head_dim)
        if self.sinks:
            layer = replace(layer, sinks=q.new_zeros(num_heads))
        scales = getattr(kv_layer, "scales", None)
        if scales is not None:
            layer = replace(layer, kv_scales=scales.values)
        launches = 0
        for num_splits in (1, 2):
            table, kv_lens, q_rows = _pack([[0], [1], [0]], self.device)
            decode = DecodeMeta(table.view(1, 1), kv_lens, q_rows, num_splits)
            PagedAttentionInputs(no_writes, page_size, decode, None).attend(q, k_cache, v_cache, layer)
            launches += num_splits
        table, *rest = _pack([[0], [0], [2], [0], [0], [0]], self.device)
        extend = ExtendMeta(table.view(1, 1), *rest)
        PagedAttentionInputs(no_writes, page_size, None, extend).attend(q, k_cache, v_cache, layer)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return launches + 1


def _page_rows(reqs: Sequence[ForwardReq], members: list[int], page_size: int) -> list[int]:
    """The members' used pages, one row each padded to the longest, flattened."""
    rows = [reqs[i].page_ids[: cdiv(reqs[i].num_cached_tokens + len(reqs[i].input_ids), page_size)] for i in members]
    width = max(len(row) for row in rows)
    return [page for row in rows for page in row + [0] * (width - len(row))]


def _pack(parts: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """One host-to-device copy for every part, each part starting on an _ALIGN boundary."""
    values, bounds = [], []
    for part in parts:
        start = len(values)
        values += part + [0] * (-len(part) % _ALIGN)
        bounds.append((start, start + len(part)))
    packed = torch.tensor(values, dtype=torch.int32, device=device)
    return [packed[start:end] for start, end in bounds]
