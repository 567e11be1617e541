"""ForwardBatch -> the tensors one forward pass needs: flat token ids and positions, KV cache slots, attention masks."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from protocol.structs import ForwardReq
from worker.layers.attention import AttentionGroup, AttentionInputs


class BatchError(ValueError):
    """A request in the batch is inconsistent (page table too short, page id out of range, ...)."""


@dataclass(frozen=True)
class BatchInputs:
    input_ids: torch.Tensor  # (tokens,) new tokens of every request, concatenated in request order
    positions: torch.Tensor  # (tokens,)
    last_token_index: torch.Tensor  # (reqs,) row of each request's last new token
    attention: AttentionInputs

    @classmethod
    def build(
        cls, reqs: list[ForwardReq], page_size: int, num_pages: int, context_length: int, device: torch.device
    ) -> BatchInputs:
        if not reqs:
            raise BatchError("empty batch")
        for i, req in enumerate(reqs):
            _check_req(i, req, page_size, num_pages, context_length)
        page_tables = _padded([req.page_ids for req in reqs], device)  # (reqs, max_pages)
        num_new = torch.tensor([len(req.input_ids) for req in reqs], device=device)  # (reqs,)
        num_cached = torch.tensor([req.num_cached_tokens for req in reqs], device=device)  # (reqs,)
        num_tokens = sum(len(req.input_ids) for req in reqs)

        req_ids = torch.arange(len(reqs), device=device)
        req_of_token = torch.repeat_interleave(req_ids, num_new, output_size=num_tokens)  # (tokens,)
        token_ends = torch.cumsum(num_new, 0)  # (reqs,)
        offset_in_req = torch.arange(num_tokens, device=device) - (token_ends - num_new)[req_of_token]
        positions = num_cached[req_of_token] + offset_in_req  # (tokens,)
        write_slots = page_tables[req_of_token, positions // page_size] * page_size + positions % page_size

        token_starts = [0, *itertools.accumulate(len(req.input_ids) for req in reqs)][:-1]  # host side: no sync
        decodes = [i for i, req in enumerate(reqs) if len(req.input_ids) == 1]
        prefills = [i for i, req in enumerate(reqs) if len(req.input_ids) > 1]
        groups = [
            _build_group(reqs, members, token_starts, page_tables, page_size, device)
            for members in (decodes, prefills)
            if members
        ]
        return cls(
            input_ids=torch.tensor([t for req in reqs for t in req.input_ids], dtype=torch.long, device=device),
            positions=positions,
            last_token_index=token_ends - 1,
            attention=AttentionInputs(write_slots=write_slots, groups=groups),
        )


def _check_req(i: int, req: ForwardReq, page_size: int, num_pages: int, context_length: int) -> None:
    # Checked on the host: an out-of-range index on a GPU is a device-side assert that kills the process.
    if not req.input_ids:
        raise BatchError(f"request {i} has no input tokens")
    num_total = req.num_cached_tokens + len(req.input_ids)
    if num_total > context_length:
        raise BatchError(f"request {i}: {num_total} tokens exceed the context length {context_length}")
    if len(req.page_ids) * page_size < num_total:
        raise BatchError(f"request {i}: {len(req.page_ids)} pages of {page_size} cannot hold {num_total} tokens")
    if req.prompt_logprob_ids and not 0 <= req.prompt_logprob_row <= len(req.input_ids) - len(req.prompt_logprob_ids):
        raise BatchError(f"request {i}: prompt logprob rows outside its {len(req.input_ids)} input tokens")
    num_used_pages = -(-num_total // page_size)
    bad = [p for p in req.page_ids[:num_used_pages] if not 0 <= p < num_pages]
    if bad:
        raise BatchError(f"request {i}: page ids {bad[:4]} outside 0..{num_pages - 1}")


def _padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long, device=device)


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
    max_kv_pages = -(-max(c + q for c, q in zip(cached_lens, q_lens, strict=True)) // page_size)
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
    return AttentionGroup(
        token_rows=torch.tensor(token_rows, device=device),
        query_index=torch.tensor(query_index, device=device),
        read_pages=read_pages,
        kv_lens=total.view(-1),
        mask=mask.unsqueeze(1),
        num_reqs=len(members),
        max_q_len=max_q_len,
        page_size=page_size,
    )
