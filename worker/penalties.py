"""Logit processing that reads a request's state: presence / frequency / repetition penalties, min_new_tokens, and
vLLM's logit controls (allowed_token_ids, bad_words, logit_bias).

The penalties need every token of a request so far. Each rank keeps them per request (`TokenHistories`, keyed by the
scheduler's req_key), built from the tokens the passes feed in: a prefill chunk's prompt tokens, a decode step's last
sampled token. A prefix the request took from the cache never passes through, so the first pass after admission
carries those tokens (history_ids). Only requests that use a penalty are tracked; the rest cost nothing.

Definitions (vLLM's, OpenAI's for presence/frequency): with c[t] the count of token t in the output so far,
    logits[t] -= frequency_penalty * c[t] + presence_penalty * (c[t] > 0)
and for every token t in the prompt or the output, repetition_penalty r (HF's RepetitionPenaltyLogitsProcessor):
    logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
applied first. Before the penalties, as vLLM orders them: allowed_token_ids bans every other token, a bad word's
last token is banned where the output so far ends with the rest of the word (vLLM's rule, output tokens only), and
logit_bias adds its values.
"""

from __future__ import annotations

import torch
from loraplex.protocol.structs import ForwardReq
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.sampling_batch import SamplingBatch
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

    def update(self, reqs: list[ForwardReq], rows: list[int]) -> None:
        """Take this pass's input tokens (positions num_cached_tokens on) of the requests at `rows` (those that read
        their history: SamplingBatch.history_rows)."""
        for i in rows:
            req = reqs[i]
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


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch, histories: TokenHistories) -> torch.Tensor:
    """logits (reqs, vocab) -> the same with each asking row processed (a new tensor; the input is unchanged, so
    logprobs still read the raw logits). Returns the input itself when no row asks."""
    rows = batch.penalty_rows
    banned_rows, banned_ids = batch.banned
    bad_rows, bad_ids = bad_word_bans(batch, histories)
    banned_rows, banned_ids = banned_rows + bad_rows, banned_ids + bad_ids
    allowed_rows, allowed_ids = batch.allowed
    bias_rows, bias_ids, bias_values = batch.bias
    if not (rows or banned_rows or allowed_rows or bias_rows):
        return logits
    logits = logits.clone()
    if allowed_rows:
        _keep_only_(logits, allowed_rows, allowed_ids)
    if banned_rows:  # min_new_tokens: the stop tokens (EOS among them unless ignore_eos); bad words
        logits[banned_rows, banned_ids] = float("-inf")
    if bias_rows:
        logits[bias_rows, bias_ids] += torch.tensor(bias_values, dtype=logits.dtype, device=logits.device)
    if len(rows) == len(batch.params):
        _penalise_(logits, batch, None, histories)
    elif rows:
        index = torch.tensor(rows, device=logits.device)
        penalised = logits[index]  # (rows that ask, vocab)
        _penalise_(penalised, batch, index, histories)
        logits[index] = penalised
    return logits


def _penalise_(
    logits: torch.Tensor, batch: SamplingBatch, index: torch.Tensor | None, histories: TokenHistories
) -> None:
    """In place, on the logits of the batch's penalty rows (`index`; None: every row). Only the logits of tokens in
    a row's history change: they are gathered, penalised and scattered back, so the work grows with the histories,
    not rows x vocab (a repeated token writes the same value each time)."""
    device = logits.device
    rows = batch.penalty_rows
    seqs = [histories.tokens(batch.req_keys[i]) for i in rows]
    lengths = torch.tensor([len(s) for s in seqs], device=device)  # (rows,)
    # The output starts after the prompt: len(history) - num_generated on the pass that samples.
    num_generated = torch.tensor([batch.num_generated[i] for i in rows], device=device)
    ids = pad_sequence(seqs, batch_first=True, padding_value=-1).to(device)  # (rows, width)
    positions = torch.arange(ids.shape[1], device=device)[None, :]
    is_output = (positions >= (lengths - num_generated)[:, None]) & (positions < lengths[:, None])
    ids = torch.where(ids < 0, ids[:, :1], ids)  # padding repeats the row's first token: it counts 0, writes the same
    counts = torch.zeros_like(logits).scatter_add_(1, ids, is_output.to(logits.dtype)).gather(1, ids)  # (rows, width)
    penalties = batch.penalties(index)  # (rows, 3) float32, as the logits
    repetition, frequency, presence = penalties[:, 0:1], penalties[:, 1:2], penalties[:, 2:3]  # (rows, 1)
    values = logits.gather(1, ids)  # (rows, width)
    values = torch.where(values > 0, values / repetition, values * repetition)
    values -= frequency * counts
    values -= presence * (counts > 0).to(logits.dtype)
    logits.scatter_(1, ids, values)


def _keep_only_(logits: torch.Tensor, rows: list[int], ids: list[int]) -> None:
    """In place: in each of `rows` (repeated once per allowed id), every token but its `ids` at -inf."""
    index = torch.tensor(sorted(set(rows)), device=logits.device)
    kept = torch.full((len(index), logits.shape[-1]), float("-inf"), dtype=logits.dtype, device=logits.device)
    local = torch.searchsorted(index, torch.tensor(rows, device=logits.device))  # each row's place in `index`
    kept[local, torch.tensor(ids, device=logits.device)] = 0.0
    logits[index] += kept  # (rows that ask, vocab)


def bad_word_bans(batch: SamplingBatch, histories: TokenHistories) -> tuple[list[int], list[int]]:
    """(rows, token ids) to ban for the bad words of several tokens: a word's last token, in each row whose output
    so far ends with the word's other tokens (vLLM's rule; the output is the history's last num_generated tokens)."""
    rows, ids = [], []
    for i in batch.bad_word_rows:
        num_generated = batch.num_generated[i]
        history = histories.tokens(batch.req_keys[i])
        output = history[len(history) - num_generated :].tolist() if num_generated else []
        for word in batch.params[i].bad_words_ids:
            prefix_len = len(word) - 1
            if prefix_len == 0 or prefix_len > len(output):  # one-token words are SamplingBatch.banned
                continue
            if output[len(output) - prefix_len :] == word[:-1]:
                rows.append(i)
                ids.append(word[-1])
    return rows, ids
