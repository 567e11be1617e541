"""Logit processing that reads a request's state: presence / frequency / repetition penalties and min_new_tokens.

The penalties need every token of a request so far. Each rank keeps them per request (`TokenHistories`, keyed by the
scheduler's req_key), built from the tokens the passes feed in: a prefill chunk's prompt tokens, a decode step's last
sampled token. A prefix the request took from the cache never passes through, so the first pass after admission
carries those tokens (history_ids). Only requests that use a penalty are tracked; the rest cost nothing.

Definitions (vLLM's, OpenAI's for presence/frequency): with c[t] the count of token t in the output so far,
    logits[t] -= frequency_penalty * c[t] + presence_penalty * (c[t] > 0)
and for every token t in the prompt or the output, repetition_penalty r (HF's RepetitionPenaltyLogitsProcessor):
    logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
applied first.
"""

from __future__ import annotations

import torch
from loraplex.protocol.structs import ForwardReq
from loraplex.worker.batch_inputs import BatchError
from torch.nn.utils.rnn import pad_sequence


class TokenHistories:
    """req_key -> every token of the request so far (prompt, then output), for requests that use a penalty. Each is
    a host int64 buffer that grows by doubling, so a decode step appends one scalar and a pass reads views."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}
        self._lengths: dict[int, int] = {}

    def __contains__(self, key: int) -> bool:
        return key in self._buffers

    def release(self, keys: list[int]) -> None:
        for key in keys:
            self._buffers.pop(key, None)
            self._lengths.pop(key, None)

    def update(self, reqs: list[ForwardReq]) -> None:
        """Take this pass's input tokens (positions num_cached_tokens on) of every request that needs them."""
        for i, req in enumerate(reqs):
            if not req.sampling.needs_token_history:
                continue
            key = req.req_key
            if key < 0:
                raise BatchError(f"request {i} uses a penalty but has no req_key")
            if req.history_ids is not None:  # (re)admitted: the tokens of its cached prefix
                self._buffers[key] = torch.tensor(req.history_ids, dtype=torch.long)
                self._lengths[key] = len(req.history_ids)
            length = self._lengths.get(key, 0)
            if length < req.num_cached_tokens:
                raise BatchError(f"request {i}: {req.num_cached_tokens} cached tokens but a history of {length}")
            # A recomputation (after preemption) writes positions from num_cached_tokens again.
            self._append(key, req.num_cached_tokens, req.input_ids)

    def _append(self, key: int, start: int, token_ids: list[int]) -> None:
        buffer = self._buffers.get(key)
        end = start + len(token_ids)
        if buffer is None or len(buffer) < end:
            grown = torch.empty(max(2 * end, 16), dtype=torch.long)
            if buffer is not None:
                grown[:start] = buffer[:start]
            buffer = self._buffers[key] = grown
        if len(token_ids) == 1:
            buffer[start] = token_ids[0]
        else:
            buffer[start:end] = torch.tensor(token_ids, dtype=torch.long)
        self._lengths[key] = end

    def tokens(self, key: int) -> torch.Tensor:
        return self._buffers[key][: self._lengths[key]]  # (length,)


def apply_penalties(logits: torch.Tensor, reqs: list[ForwardReq], histories: TokenHistories) -> torch.Tensor:
    """logits (reqs, vocab) -> the same with each asking row penalised (a new tensor; the input is unchanged, so
    logprobs still read the raw logits). Returns the input itself when no row asks."""
    rows = [i for i, req in enumerate(reqs) if req.sampling.needs_token_history]
    vocab_size = logits.shape[-1]
    # min_new_tokens: the stop tokens (EOS among them unless ignore_eos) cannot be sampled yet.
    masked = [
        (i, t)
        for i, req in enumerate(reqs)
        if req.num_generated < req.sampling.min_new_tokens
        for t in req.sampling.stop_token_ids
        if t < vocab_size
    ]
    if not rows and not masked:
        return logits
    logits = logits.clone()
    if masked:
        logits[[i for i, _ in masked], [t for _, t in masked]] = float("-inf")
    if len(rows) == len(reqs):
        _penalise_(logits, reqs, histories)
    elif rows:
        index = torch.tensor(rows, device=logits.device)
        penalised = logits[index]  # (rows that ask, vocab)
        _penalise_(penalised, [reqs[i] for i in rows], histories)
        logits[index] = penalised
    return logits


def _penalise_(logits: torch.Tensor, reqs: list[ForwardReq], histories: TokenHistories) -> None:
    """In place. Only the logits of tokens in a row's history change: they are gathered, penalised and scattered
    back, so the work grows with the histories, not rows x vocab (a repeated token writes the same value each time)."""
    device = logits.device
    seqs = [histories.tokens(req.req_key) for req in reqs]
    lengths = torch.tensor([len(s) for s in seqs], device=device)  # (rows,)
    # The output starts after the prompt: len(history) - num_generated on the pass that samples.
    num_generated = torch.tensor([req.num_generated for req in reqs], device=device)
    ids = pad_sequence(seqs, batch_first=True, padding_value=-1).to(device)  # (rows, width)
    positions = torch.arange(ids.shape[1], device=device)[None, :]
    is_output = (positions >= (lengths - num_generated)[:, None]) & (positions < lengths[:, None])
    ids = torch.where(ids < 0, ids[:, :1], ids)  # padding repeats the row's first token: it counts 0, writes the same
    counts = torch.zeros_like(logits).scatter_add_(1, ids, is_output.to(logits.dtype)).gather(1, ids)  # (rows, width)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device)[:, None]  # (rows, 1)

    values = logits.gather(1, ids)  # (rows, width)
    repetition = column([req.sampling.repetition_penalty for req in reqs])
    values = torch.where(values > 0, values / repetition, values * repetition)
    values -= column([req.sampling.frequency_penalty for req in reqs]) * counts
    values -= column([req.sampling.presence_penalty for req in reqs]) * (counts > 0).to(logits.dtype)
    logits.scatter_(1, ids, values)
