"""Next-token choice per request: greedy, or temperature / min-p / top-k / top-p sampling.

A request with a seed is sampled from a generator seeded by (seed, num_generated): the same request gives the same
tokens whatever it is batched with, and no state is kept between steps. Requests without a seed share one
process-level generator seeded from the server's --seed. Sampling draws one exponential variate per token and takes
argmax(probs / noise), which picks token t with probability probs[t]; so the draw is a per-row tensor op.
"""

from __future__ import annotations

import torch
from loraplex.protocol.structs import ForwardReq, SamplingParams, TokenLogprob

_MASK64 = (1 << 64) - 1


def request_seed(seed: int, num_generated: int) -> int:
    """A well-mixed 63-bit generator seed for step `num_generated` of a request (splitmix64 finaliser)."""
    x = (seed * 0x9E3779B97F4A7C15 + num_generated + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature <= 0.0


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int]) -> list[int]:
        """logits (reqs, vocab) float32 -> one token id per request."""
        greedy = [is_greedy(p) for p in params]
        if all(greedy):
            return logits.argmax(dim=-1).tolist()
        probs = self._probs(logits, params, greedy)  # (reqs, vocab), zero outside each request's top-k / top-p
        noise = self._exponential_noise(logits.shape, params, num_generated, greedy)  # (reqs, vocab)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy_row = torch.tensor(greedy, device=logits.device)
        return torch.where(is_greedy_row, logits.argmax(dim=-1), sampled).tolist()

    def _probs(self, logits: torch.Tensor, params: list[SamplingParams], greedy: list[bool]) -> torch.Tensor:
        num_reqs, vocab_size = logits.shape
        temperatures = torch.tensor(
            [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)], device=logits.device
        )  # greedy rows are scaled by 1 only to stay finite; their token is the argmax anyway
        scaled = logits / temperatures[:, None]  # (reqs, vocab)
        if any(p.min_p > 0.0 for p in params):
            scaled = _min_p_filtered(scaled, params)
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_ps = [p.top_p for p in params]
        if all(k == vocab_size for k in top_ks) and all(p >= 1.0 for p in top_ps):
            return scaled.softmax(dim=-1)
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # (reqs, vocab)
        ranks = torch.arange(vocab_size, device=logits.device)
        removed = ranks[None, :] >= torch.tensor(top_ks, device=logits.device)[:, None]
        sorted_probs = sorted_logits.masked_fill(removed, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        removed |= mass_before >= torch.tensor(top_ps, device=logits.device)[:, None]
        removed[:, 0] = False
        sorted_probs = sorted_probs.masked_fill(removed, 0.0)
        return torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)

    def _exponential_noise(
        self, shape: torch.Size, params: list[SamplingParams], num_generated: list[int], greedy: list[bool]
    ) -> torch.Tensor:
        noise = torch.ones(shape, device=self.device)  # greedy rows keep 1 and draw nothing
        unseeded_rows = []
        for row, (p, step, g) in enumerate(zip(params, num_generated, greedy, strict=True)):
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


def _min_p_filtered(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Drop the tokens whose probability is below min_p x the most likely token's (HF's MinPLogitsWarper)."""
    probs = scaled.softmax(dim=-1)  # (reqs, vocab)
    min_ps = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)[:, None]  # (reqs, 1)
    removed = probs < min_ps * probs.max(dim=-1, keepdim=True).values  # never the top token
    return scaled.masked_fill(removed, float("-inf"))


def token_logprobs(
    logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
) -> list[TokenLogprob | None]:
    """Per row, the chosen token's logprob and the top-N (best first) where the row asks (logprobs >= 0), else None;
    [] when no row asks. Log-softmax of the raw logits in fp32, computed only for the rows that ask, vectorised."""
    rows = [i for i, p in enumerate(params) if p.logprobs >= 0]
    if not rows:
        return []
    index = torch.tensor(rows, device=logits.device)
    entries = logprob_entries(logits[index], [tokens[i] for i in rows], [params[i].logprobs for i in rows])
    out: list[TokenLogprob | None] = [None] * len(params)
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


def prompt_logprobs(logits: torch.Tensor, reqs: list[ForwardReq]) -> list[list[TokenLogprob]]:
    """logits (prompt_logprob_rows, vocab) -> per request, its prompt_logprob_ids' entries; [] when none asks."""
    if not len(logits):
        return []
    ids = [t for req in reqs for t in req.prompt_logprob_ids]
    nums = [max(req.sampling.logprobs, 0) for req in reqs for _ in req.prompt_logprob_ids]
    entries = logprob_entries(logits, ids, nums)
    out, start = [], 0
    for req in reqs:
        out.append(entries[start : start + len(req.prompt_logprob_ids)])
        start += len(req.prompt_logprob_ids)
    return out


def logprob_entries(logits: torch.Tensor, chosen_ids: list[int], nums: list[int]) -> list[TokenLogprob]:
    """logits (rows, vocab) -> per row, chosen_ids[row]'s logprob and the nums[row] best (log-softmax in fp32)."""
    logprobs = logits.float().log_softmax(dim=-1)  # (rows, vocab)
    chosen_index = torch.tensor(chosen_ids, device=logits.device)[:, None]  # (rows, 1)
    chosen = logprobs.gather(1, chosen_index)[:, 0].tolist()
    num_top = min(max(nums), logprobs.shape[-1])
    top_values: list[list[float]] = [[] for _ in nums]
    top_ids: list[list[int]] = [[] for _ in nums]
    if num_top > 0:
        values, ids = logprobs.topk(num_top, dim=-1)  # sorted, best first
        top_values, top_ids = values.tolist(), ids.tolist()
    return [TokenLogprob(chosen[j], top_ids[j][:n], top_values[j][:n]) for j, n in enumerate(nums)]
