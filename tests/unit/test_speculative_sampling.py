"""Speculative decoding's verify step (worker/speculative.py) against the target distribution: greedy gives the
argmax run exactly; at temperature 1, rejection sampling of one-hot (n-gram) drafts gives tokens whose frequencies
match the target's probabilities (chi-square over fixed seeds, bounded samples)."""

from __future__ import annotations

import torch
from loraplex.protocol.structs import ForwardReq, SamplingParams
from loraplex.worker.sampler import Sampler, logprob_entries
from loraplex.worker.sampling_batch import SamplingBatch
from loraplex.worker.speculative import draft_rows, verify_drafts

VOCAB = 6
NUM_SAMPLES = 1000
# chi-square critical value for 5 degrees of freedom at p = 0.001: a correct sampler fails one seed in a thousand
CHI2_CRITICAL_DF5 = 20.52


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams, sampler: Sampler):
    """logits (k + 1, vocab) of one request whose pass verifies `drafts`: its accepted drafts and next token."""
    req = ForwardReq(input_ids=[0, *drafts], num_cached_tokens=5, page_ids=[0, 1], num_draft_tokens=len(drafts),
                     req_key=1)  # fmt: skip
    sampling = SamplingBatch.of([req], [params], VOCAB, torch.device("cpu"))
    k = len(drafts)
    assert draft_rows([req]) == list(range(k))
    tokens = [-1]
    [accepted], _ = verify_drafts([req], sampling, logits[k:], logits[:k], tokens, sampler)
    return accepted, tokens[0]


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


def test_greedy_accepts_the_argmax_run_and_corrects_the_first_miss():
    logits = torch.full((4, VOCAB), -1.0)
    for row, best in enumerate([2, 5, 1, 3]):
        logits[row, best] = 1.0
    sampler = Sampler(0, torch.device("cpu"))
    greedy = SamplingParams(temperature=0.0)
    assert verify(logits, [2, 5, 1], greedy, sampler) == ([2, 5, 1], 3)  # all accepted: the bonus token
    assert verify(logits, [2, 4, 1], greedy, sampler) == ([2], 5)  # the first miss is replaced by the argmax
    assert verify(logits, [0, 5, 1], greedy, sampler) == ([], 2)


def test_each_output_token_s_logprob_comes_from_its_own_row():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))  # (k + 1, vocab)
    best = logits.argmax(dim=-1).tolist()
    drafts = [best[0], best[1], (best[2] + 1) % VOCAB]  # two accepted, the third rejected
    params = SamplingParams(temperature=0.0, logprobs=2)
    req = ForwardReq(input_ids=[0, *drafts], num_cached_tokens=5, page_ids=[0, 1, 2], num_draft_tokens=3,
                     req_key=1)  # fmt: skip
    sampling = SamplingBatch.of([req], [params], VOCAB, torch.device("cpu"))
    tokens, logprobs = [-1], [None]
    [accepted], [accepted_logprobs] = verify_drafts([req], sampling, logits[3:], logits[:3], tokens,
                                                    Sampler(0, torch.device("cpu")), logprobs)  # fmt: skip
    assert accepted == drafts[:2] and tokens == [best[2]]
    expected = logprob_entries(logits[:3], [*drafts[:2], best[2]], [2, 2, 2])  # rows 0, 1, 2: as decoding one by one
    assert [*accepted_logprobs, logprobs[0]] == expected


def test_rejection_sampling_keeps_the_target_distribution():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=generator)  # (k + 1, vocab): rows 0 and 1 verify the drafts
    target = logits.softmax(dim=-1)
    drafts = [int(target[0].argmax()), int(target[1].argmax())]  # often accepted, often not
    sampler = Sampler(0, torch.device("cpu"))
    first, second_after_hit = [0] * VOCAB, [0] * VOCAB
    for seed in range(NUM_SAMPLES):
        accepted, token = verify(logits, drafts, SamplingParams(temperature=1.0, seed=seed), sampler)
        out = [*accepted, token]
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second_after_hit[out[1]] += 1  # the token after an accepted draft follows row 1's distribution
    assert 0 < first[drafts[0]] < NUM_SAMPLES  # both acceptance and rejection happened
    assert chi_square(first, target[0].tolist()) < CHI2_CRITICAL_DF5
    assert sum(second_after_hit) > 100
    assert chi_square(second_after_hit, target[1].tolist()) < CHI2_CRITICAL_DF5
    # seeded: the same seed gives the same tokens
    params = SamplingParams(temperature=1.0, seed=7)
    assert verify(logits, drafts, params, sampler) == verify(logits, drafts, params, sampler)
