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

from protocol.structs import ForwardReq
from worker.batch_inputs import BatchError


class TokenHistories:
    """req_key -> every token of the request so far (prompt, then output), for requests that use a penalty."""

    def __init__(self) -> None:
        self._tokens: dict[int, list[int]] = {}

    def __contains__(self, key: int) -> bool:
        return key in self._tokens

    def release(self, keys: list[int]) -> None:
        for key in keys:
            self._tokens.pop(key, None)

    def update(self, reqs: list[ForwardReq]) -> None:
        """Take this pass's input tokens (positions num_cached_tokens on) of every request that needs them."""
        for i, req in enumerate(reqs):
            if not req.sampling.needs_token_history:
                continue
            if req.req_key < 0:
                raise BatchError(f"request {i} uses a penalty but has no req_key")
            tokens = list(req.history_ids) if req.history_ids is not None else self._tokens.get(req.req_key, [])
            if len(tokens) < req.num_cached_tokens:
                raise BatchError(f"request {i}: {req.num_cached_tokens} cached tokens but a history of {len(tokens)}")
            del tokens[req.num_cached_tokens :]  # a recomputation (after preemption) writes them again
            tokens += req.input_ids
            self._tokens[req.req_key] = tokens

    def tokens(self, key: int) -> list[int]:
        return self._tokens[key]


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
    if rows:
        logits[rows] = _penalised(logits[rows], [reqs[i] for i in rows], histories)
    return logits


def _penalised(logits: torch.Tensor, reqs: list[ForwardReq], histories: TokenHistories) -> torch.Tensor:
    device = logits.device
    num_rows, vocab_size = logits.shape
    seqs = [histories.tokens(req.req_key) for req in reqs]
    width = max(len(s) for s in seqs)
    # Padding points at an extra column that is dropped afterwards.
    ids = torch.tensor([s + [vocab_size] * (width - len(s)) for s in seqs], device=device)  # (rows, width)
    # The output starts after the prompt: len(history) - num_generated on the pass that samples.
    num_prompt = torch.tensor([len(s) - req.num_generated for s, req in zip(seqs, reqs, strict=True)], device=device)
    is_output = (torch.arange(width, device=device)[None, :] >= num_prompt[:, None]).to(logits.dtype)  # (rows, width)
    seen = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=device)
    seen.scatter_(1, ids, 1.0)
    output_counts = torch.zeros_like(seen).scatter_add_(1, ids, is_output)[:, :vocab_size]  # (rows, vocab)
    seen = seen[:, :vocab_size] > 0

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype, device=device)[:, None]  # (rows, 1)

    repetition = column([req.sampling.repetition_penalty for req in reqs])
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    logits = logits - column([req.sampling.frequency_penalty for req in reqs]) * output_counts
    return logits - column([req.sampling.presence_penalty for req in reqs]) * (output_counts > 0).to(logits.dtype)
