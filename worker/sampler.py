"""Next-token choice per request: greedy, or temperature / min-p / top-k / top-p sampling.

A request with a seed is sampled from a generator seeded by (seed, num_generated): the same request gives the same
tokens whatever it is batched with, and no state is kept between steps. Requests without a seed share one
process-level generator seeded from the server's --seed. Sampling draws one exponential variate per token and takes
argmax(probs / noise), which picks token t with probability probs[t]; so the draw is a per-row tensor op.
"""

from __future__ import annotations

import torch
from loraplex.protocol.structs import ForwardReq, TokenLogprob
from loraplex.worker.sampling_batch import SamplingBatch

_MASK64 = (1 << 64) - 1


def request_seed(seed: int, num_generated: int) -> int:
    """A well-mixed 63-bit generator seed for step `num_generated` of a request (splitmix64 finaliser)."""
    x = (seed * 0x9E3779B97F4A7C15 + num_generated + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> list[int]:
        """logits (reqs, vocab) float32 -> one token id per request."""
        if batch.is_all_greedy:
            return logits.argmax(dim=-1).tolist()
        probs = self.probs(logits, batch)  # (reqs, vocab), zero outside each request's top-k / top-p
        noise = self._exponential_noise(logits.shape, batch)  # (reqs, vocab)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(batch.greedy_mask, logits.argmax(dim=-1), sampled).tolist()

    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """(rows, vocab) the distribution each row samples from: softmax at its temperature, after min-p, top-k and
        top-p (greedy rows: at temperature 1)."""
        vocab_size = logits.shape[-1]
        scaled = logits / batch.temperatures  # (reqs, vocab)
        if batch.uses_min_p:
            scaled = _min_p_filtered(scaled, batch.min_ps)
        if not batch.uses_top_k_or_p:
            return scaled.softmax(dim=-1)
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # (reqs, vocab)
        ranks = torch.arange(vocab_size, device=logits.device)
        removed = ranks[None, :] >= batch.top_ks[:, None]
        sorted_probs = sorted_logits.masked_fill(removed, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        removed |= mass_before >= batch.top_ps
        removed[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(removed, 0.0)
        return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)

    def row_generator(self, seed: int | None, step: int) -> torch.Generator:
        """The generator of a request's step: seeded by (seed, step), or the process's shared one."""
        if seed is None:
            return self.generator
        generator = torch.Generator(device=self.device)
        generator.manual_seed(request_seed(seed, step))
        return generator

    def _exponential_noise(self, shape: torch.Size, batch: SamplingBatch) -> torch.Tensor:
        noise = torch.ones(shape, device=self.device)  # greedy rows keep 1 and draw nothing
        unseeded_rows = []
        for row, (p, step, g) in enumerate(zip(batch.params, batch.num_generated, batch.is_greedy, strict=True)):
            if g:
                continue
            if p.seed is None:
                unseeded_rows.append(row)
                continue
            generator = torch.Generator(device=self.device)
            generator.manual_seed(request_seed(p.seed, step))
            noise[row].exponential_(generator=generator)
        if unseeded_rows:
            rows = torch.tensor(unseeded_rows, device=self.device)
            noise[rows] = torch.empty(len(rows), shape[1], device=self.device).exponential_(generator=self.generator)
        # An exponential draw of exactly 0 would give inf / nan scores.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _min_p_filtered(scaled: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Drop the tokens whose probability is below min_p x the most likely token's (HF's MinPLogitsWarper)."""
    probs = scaled.softmax(dim=-1)  # (reqs, vocab)
    removed = probs < min_ps * probs.max(dim=-1, keepdim=True).values  # min_ps (reqs, 1); never the top token
    return scaled.masked_fill(removed, float("-inf"))


def token_logprobs(logits: torch.Tensor, batch: SamplingBatch, tokens: list[int]) -> list[TokenLogprob | None]:
    """Per row, the chosen token's logprob and the top-N (best first) where the row asks (logprobs >= 0), else None;
    [] when no row asks. Log-softmax of the raw logits in fp32, computed only for the rows that ask, vectorised."""
    rows = batch.logprob_rows
    if not rows:
        return []
    index = torch.tensor(rows, device=logits.device)
    entries = logprob_entries(logits[index], [tokens[i] for i in rows], [batch.params[i].logprobs for i in rows])
    out: list[TokenLogprob | None] = [None] * len(batch.params)
    for i, entry in zip(rows, entries, strict=True):
        out[i] = entry
    return out


def prompt_logprob_rows(reqs: list[ForwardReq]) -> list[int]:
    """The flat token rows (the batch's new tokens in request order) whose logits give the asked prompt logprobs."""
    rows, start = [], 0
    for req in reqs:
        first = start + req.prompt_logprob_row
        rows += range(first, first + len(req.prompt_logprob_ids))
        start += len(req.input_ids)
    return rows


def prompt_logprobs(logits: torch.Tensor, reqs: list[ForwardReq], batch: SamplingBatch) -> list[list[TokenLogprob]]:
    """logits (prompt_logprob_rows, vocab) -> per request, its prompt_logprob_ids' entries; [] when none asks."""
    if not len(logits):
        return []
    ids = [t for req in reqs for t in req.prompt_logprob_ids]
    nums = [p.prompt_top_logprobs for req, p in zip(reqs, batch.params, strict=True) for _ in req.prompt_logprob_ids]
    entries = logprob_entries(logits, ids, nums)
    out, start = [], 0
    for req in reqs:
        out.append(entries[start : start + len(req.prompt_logprob_ids)])
        start += len(req.prompt_logprob_ids)
    return out


def logprob_entries(logits: torch.Tensor, chosen_ids: list[int], nums: list[int]) -> list[TokenLogprob]:
    """logits (rows, vocab) -> per row, chosen_ids[row]'s logprob and rank and the nums[row] best (log-softmax in
    fp32)."""
    logprobs = logits.float().log_softmax(dim=-1)  # (rows, vocab)
    chosen_index = torch.tensor(chosen_ids, device=logits.device)[:, None]  # (rows, 1)
    chosen_values = logprobs.gather(1, chosen_index)  # (rows, 1)
    chosen = chosen_values[:, 0].tolist()
    ranks = (logprobs >= chosen_values).sum(dim=-1).tolist()  # ties rank the chosen token last among them
    num_top = min(max(nums), logprobs.shape[-1])
    top_values: list[list[float]] = [[] for _ in nums]
    top_ids: list[list[int]] = [[] for _ in nums]
    if num_top > 0:
        values, ids = logprobs.topk(num_top, dim=-1)  # sorted, best first
        top_values, top_ids = values.tolist(), ids.tolist()
    return [TokenLogprob(chosen[j], top_ids[j][:n], top_values[j][:n], ranks[j]) for j, n in enumerate(nums)]
