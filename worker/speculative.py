"""Speculative decoding's verify step: a request's draft tokens against the target's logits at their positions.

Each verify row is processed as the same token's row without drafts: penalties and logit controls over the tokens
before it (the drafts before it included), min_new_tokens by its own step, and a grammar's mask as the grammar
stands after the drafts before it (a draft the grammar refuses is masked out, so acceptance ends there).
Greedy: the drafts equal to the target's processed argmax are accepted, up to the first that is not, and the argmax
there (or after the last draft) follows: exactly the tokens decoding without drafts gives. Temperature > 0 (rejection
sampling, Leviathan et al. 2023; an n-gram draft's distribution is one-hot): draft d at row j is accepted with
probability p_j(d), else the token is drawn from the residual, p_j without d renormalised; after k accepted drafts one
more is drawn from p_k. Each output token is then distributed exactly as the target's p. Row j's draws come from the
request's generator of step num_generated + j, so a seeded request's tokens do not depend on its batch, and a recompute
after a preemption (same history, same drafts) gives the same tokens.
"""

from __future__ import annotations

import torch
from loraplex.protocol.structs import ForwardReq, TokenLogprob
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.grammar import GrammarMasks
from loraplex.worker.penalties import TokenHistories, apply_penalties
from loraplex.worker.sampler import Sampler, logprob_entries
from loraplex.worker.sampling_batch import SamplingBatch


def draft_rows(reqs: list[ForwardReq]) -> list[int]:
    """The flat token rows (the batch's new tokens in request order) whose logits verify the drafts: for a request
    with k drafts, its rows before its last (the last row's logits come with every request's)."""
    rows, start = [], 0
    for req in reqs:
        if req.num_draft_tokens:
            last = start + len(req.input_ids) - 1
            rows += range(last - req.num_draft_tokens, last)
        start += len(req.input_ids)
    return rows


def check_drafts(reqs: list[ForwardReq], sampling: SamplingBatch, *, has_draft_model: bool) -> None:
    """A bad batch fails on every rank alike, before the forward."""
    for req, params in zip(reqs, sampling.params, strict=True):
        if req.num_model_drafts and (not has_draft_model or req.num_draft_tokens):
            raise BatchError(f"request {req.req_key} asks for {req.num_model_drafts} draft-model tokens, but "
                             + ("it carries drafts already" if has_draft_model else "no draft model runs here"))
        if not req.num_draft_tokens and not req.num_model_drafts:
            continue
        if req.num_draft_tokens >= len(req.input_ids):
            raise BatchError(f"request {req.req_key}: {req.num_draft_tokens} draft tokens need a known token before "
                             "them")  # fmt: skip
        if not params.allows_drafts:
            raise BatchError(f"request {req.req_key}: its grammar (after a reasoning section, or sampled without a "
                             "seed) is not verified with drafts")  # fmt: skip


def verify_drafts(
    reqs: list[ForwardReq],
    sampling: SamplingBatch,
    last_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    tokens: list[int],
    sampler: Sampler,
    logprobs: list[TokenLogprob | None] | None = None,
    histories: TokenHistories | None = None,
    grammar: GrammarMasks | None = None,
) -> tuple[list[list[int]], list[list[TokenLogprob]]]:
    """last_logits (reqs, vocab), draft_logits (draft_rows, vocab): per request, its accepted drafts ([] for one
    without) and, where it asks for logprobs, theirs; tokens[i] becomes the token that follows them, and
    logprobs[i] (token_logprobs' list, for requests that ask) its entry. histories: the requests' tokens so far, the
    pass's drafts included (TokenHistories.update); grammar: the constrained requests' matchers (then call
    grammar.record_drafts after)."""
    accepted_ids: list[list[int]] = [[] for _ in reqs]
    accepted_logprobs: list[list[TokenLogprob]] = [[] for _ in reqs]
    start = 0
    for i, req in enumerate(reqs):
        k = req.num_draft_tokens
        if not k:
            continue
        logits = torch.cat([draft_logits[start : start + k], last_logits[i : i + 1]])  # (k + 1, vocab)
        start += k
        drafts = req.input_ids[-k:]
        params, step = sampling.params[i], sampling.num_generated[i]
        # row j samples output token step + j, after the drafts before it: its own row of a batch (keys 0..k index
        # the history views)
        rows = SamplingBatch.build([params] * (k + 1), [step + j for j in range(k + 1)], list(range(k + 1)),
                                   logits.shape[-1], logits.device)  # fmt: skip
        processed = apply_penalties(logits, rows, _DraftHistories(histories, req.req_key, k))  # (k + 1, vocab)
        if params.constraint is not None and grammar is not None:
            processed = grammar.mask_drafts(processed, req, params)
        if sampling.is_greedy[i]:
            best = processed.argmax(dim=-1).tolist()
            num_accepted = next((j for j in range(k) if best[j] != drafts[j]), k)
            accepted_ids[i], tokens[i] = drafts[:num_accepted], best[num_accepted]
        else:
            probs = sampler.probs(processed.float(), rows)  # (k + 1, vocab)
            accepted_ids[i], tokens[i] = _rejection_sample(probs, drafts, params.seed, step, sampler)
        if params.logprobs >= 0 and logprobs:  # row j's raw logits give output token j's logprob, as without drafts
            num_rows = len(accepted_ids[i]) + 1
            entries = logprob_entries(logits[:num_rows], [*accepted_ids[i], tokens[i]], [params.logprobs] * num_rows)
            accepted_logprobs[i], logprobs[i] = entries[:-1], entries[-1]
    return accepted_ids, accepted_logprobs


class _DraftHistories:
    """A drafted request's token history as its verify rows see it: row j's (key j) ends after the first j drafts.
    TokenHistories already holds the pass's drafts (they are its input tokens)."""

    def __init__(self, histories: TokenHistories | None, req_key: int, num_drafts: int) -> None:
        self.histories, self.req_key, self.num_drafts = histories, req_key, num_drafts

    def tokens(self, row: int) -> torch.Tensor:
        if self.histories is None or self.req_key not in self.histories:
            raise BatchError(f"request {self.req_key} uses a penalty but its token history is not kept")
        full = self.histories.tokens(self.req_key)  # (prompt + output so far + drafts,)
        return full[: len(full) - self.num_drafts + row]


def _rejection_sample(probs: torch.Tensor, drafts: list[int], seed: int | None, step: int,
                      sampler: Sampler) -> tuple[list[int], int]:  # fmt: skip
    """probs (k + 1, vocab): the accepted drafts, and the token after them."""
    for j, draft in enumerate(drafts):
        generator = sampler.row_generator(seed, step + j)
        uniform = torch.rand((), generator=generator, device=probs.device)
        if uniform < probs[j, draft]:
            continue
        residual = probs[j].clone()
        residual[draft] = 0.0  # (p - one-hot(draft))+ : the draft's mass is spent on its acceptance
        return drafts[:j], _draw(residual, generator)
    k = len(drafts)
    return drafts, _draw(probs[k], sampler.row_generator(seed, step + k))


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from unnormalised probs (vocab,), as the sampler draws: argmax(probs / Exp(1) noise)."""
    noise = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return int((probs / noise).argmax())
