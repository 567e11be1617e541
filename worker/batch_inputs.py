"""ForwardBatch -> the tensors one forward pass needs: flat token ids and positions, KV cache slots, attention masks."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from loraplex.protocol.mathutil import cdiv
from loraplex.protocol.structs import ForwardReq
from loraplex.worker.layers.attention import AttentionBackend, BatchAttention, SDPAAttention


class BatchError(ValueError):
    """A request in the batch is inconsistent (page table too short, page id out of range, ...)."""


@dataclass(frozen=True)
class BatchInputs:
    input_ids: torch.Tensor  # (tokens,) new tokens of every request, concatenated in request order
    # (tokens,) each token's row of the rotary tables (rotary_row); M-RoPE: (3, tokens) when a request of the pass
    # gives its tokens' three rows (ForwardReq.mrope_positions), the others' row repeated
    positions: torch.Tensor
    last_token_index: torch.Tensor  # (reqs,) row of each request's last new token
    attention: BatchAttention
    token_type_ids: torch.Tensor | None = None  # (tokens,) an encoder's segments, where a request names them

    @classmethod
    def build(
        cls,
        reqs: list[ForwardReq],
        page_size: int,
        num_pages: int,
        context_length: int,
        device: torch.device,
        attention: AttentionBackend | None = None,  # the worker's; torch's SDPA when not given (scripts, tests)
    ) -> BatchInputs:
        check_reqs(reqs, page_size, num_pages, context_length)
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
        row_offsets = torch.tensor([rotary_row(req, 0, context_length) for req in reqs], device=device)  # (reqs,)

        token_starts = [0, *itertools.accumulate(len(req.input_ids) for req in reqs)][:-1]  # host side: no sync
        attention = attention or SDPAAttention(device)
        token_type_ids = None
        if any(req.token_type_ids for req in reqs):
            types = [t for req in reqs for t in (req.token_type_ids or [0] * len(req.input_ids))]
            token_type_ids = torch.tensor(types, dtype=torch.long, device=device)
        positions = positions + row_offsets[req_of_token]
        if any(req.mrope_positions for req in reqs):
            positions = _mrope_rows(reqs, positions, token_starts, device)
        return cls(
            input_ids=torch.tensor([t for req in reqs for t in req.input_ids], dtype=torch.long, device=device),
            positions=positions,
            last_token_index=token_ends - 1,
            attention=attention.build(reqs, token_starts, page_tables, write_slots, page_size),
            token_type_ids=token_type_ids,
        )


def rotary_row(req: ForwardReq, position: int, context_length: int) -> int:
    """The row of the rotary tables (layers/rotary.py, context_length rows per set) of a token of `req` at
    `position`: longrope's long factors sit in the second set; an M-RoPE request's tokens after its images sit
    mrope_delta rows from their index (protocol/mrope.py)."""
    return position + req.mrope_delta + (context_length if req.long_rope else 0)


def _mrope_rows(reqs: list[ForwardReq], rows: torch.Tensor, token_starts: list[int], device: torch.device
                ) -> torch.Tensor:  # fmt: skip
    """(3, tokens): the requests' own M-RoPE rows where they give them, else their one row in all three."""
    out = rows.unsqueeze(0).repeat(3, 1)
    for req, start in zip(reqs, token_starts, strict=True):
        if req.mrope_positions:
            given = torch.tensor(req.mrope_positions, dtype=torch.long)
            out[:, start : start + len(req.input_ids)] = given.to(device)
    return out


def check_reqs(reqs: list[ForwardReq], page_size: int, num_pages: int, context_length: int) -> None:
    if not reqs:
        raise BatchError("empty batch")
    for i, req in enumerate(reqs):
        _check_req(i, req, page_size, num_pages, context_length)


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
    if req.token_type_ids and len(req.token_type_ids) != len(req.input_ids):
        raise BatchError(f"request {i}: {len(req.token_type_ids)} token types for {len(req.input_ids)} input tokens")
    if req.mrope_positions:
        rows = req.mrope_positions
        if len(rows) != 3 or any(len(row) != len(req.input_ids) for row in rows):
            raise BatchError(f"request {i}: M-RoPE positions must be 3 rows of its {len(req.input_ids)} input tokens")
        if not all(0 <= p < context_length for row in rows for p in row):
            raise BatchError(f"request {i}: M-RoPE positions outside 0..{context_length - 1}")
    elif not (0 <= req.num_cached_tokens + req.mrope_delta and num_total + req.mrope_delta <= context_length):
        raise BatchError(f"request {i}: mrope_delta {req.mrope_delta} puts its positions outside the context")
    num_used_pages = cdiv(num_total, page_size)
    bad = [p for p in req.page_ids[:num_used_pages] if not 0 <= p < num_pages]
    if bad:
        raise BatchError(f"request {i}: page ids {bad[:4]} outside 0..{num_pages - 1}")


def _padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.long, device=device)
