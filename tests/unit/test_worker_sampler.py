"""The sampler on fixed logits: reproducibility, greedy equivalences, and the sampled distributions."""

from __future__ import annotations

import collections

import torch
from loraplex.protocol.structs import SamplingParams
from loraplex.worker.sampler import Sampler, logprob_entries, request_seed
from loraplex.worker.sampling_batch import SamplingBatch

CPU = torch.device("cpu")


def sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], steps: list[int] | None = None):
    steps = steps if steps is not None else [0] * len(params)
    batch = SamplingBatch.build(params, steps, [-1] * len(params), logits.shape[-1], logits.device)
    return sampler.sample(logits, batch)


def frequencies(tokens: list[int], vocab_size: int) -> torch.Tensor:
    counts = collections.Counter(tokens)
    return torch.tensor([counts[t] for t in range(vocab_size)], dtype=torch.float64) / len(tokens)


def test_seeded_token_is_independent_of_batch_composition() -> None:
    logits = torch.randn(40, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(seed=0, device=CPU)
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=s) for s in range(40)]
    alone = [sample(sampler, logits[i : i + 1], [params[i]], [3])[0] for i in range(40)]
    # Batched with unseeded and greedy requests, in reverse order.
    fillers = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)]
    filler_logits = torch.randn(2, 50)
    batch_logits = torch.cat([filler_logits, logits.flip(0)])
    batched = sample(sampler, batch_logits, fillers + params[::-1], [0, 0] + [3] * 40)[2:][::-1]
    assert batched == alone
    # Sanity: the step is part of the seed, so the next step draws differently.
    next_step = sample(sampler, logits, params, [4] * 40)
    assert next_step != alone


def test_unseeded_sampling_follows_the_process_seed() -> None:
    logits = torch.zeros(64, 1000)  # uniform: any difference in draws shows
    params = [SamplingParams(temperature=1.0)] * 64
    first = sample(Sampler(seed=7, device=CPU), logits, params)
    assert sample(Sampler(seed=7, device=CPU), logits, params) == first
    assert sample(Sampler(seed=8, device=CPU), logits, params) != first


def test_greedy_and_top_k_one_take_the_argmax() -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(1))
    expected = logits.argmax(dim=-1).tolist()
    sampler = Sampler(seed=0, device=CPU)
    assert sample(sampler, logits, [SamplingParams(temperature=0.0)] * 16) == expected
    assert sample(sampler, logits, [SamplingParams(temperature=2.0, top_k=1, seed=i) for i in range(16)]) == expected
    mixed = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=5.0) for i in range(16)]
    got = sample(sampler, logits, mixed)
    assert [got[i] for i in range(1, 16, 2)] == expected[1::2]


def test_temperature_sampling_matches_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    n = 4000
    sampler = Sampler(seed=0, device=CPU)
    for temperature in (1.0, 0.5, 2.0):
        params = [SamplingParams(temperature=temperature, seed=i) for i in range(n)]
        tokens = sample(sampler, logits.expand(n, -1), params)
        expected = torch.softmax(logits.double() / temperature, dim=-1)
        # 4 sigma of a frequency over 4000 draws is at most 0.032.
        assert (frequencies(tokens, 5) - expected).abs().max().item() < 0.03, temperature


def test_top_k_and_top_p_restrict_and_renormalise() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    n = 4000
    sampler = Sampler(seed=0, device=CPU)
    # top_p = 0.75: the smallest prefix reaching 0.75 is {0, 1}; renormalised to 0.625 / 0.375.
    top_p = sample(sampler, logits.expand(n, -1), [SamplingParams(top_p=0.75, seed=i) for i in range(n)])
    freq = frequencies(top_p, 4)
    assert freq[2:].sum().item() == 0
    assert abs(freq[0].item() - 0.625) < 0.03
    # top_k = 3: {0, 1, 2}, renormalised by 0.95.
    top_k = sample(sampler, logits.expand(n, -1), [SamplingParams(top_k=3, seed=i) for i in range(n)])
    freq = frequencies(top_k, 4)
    assert freq[3].item() == 0
    assert (freq[:3] - probs[:3].double() / 0.95).abs().max().item() < 0.03


def test_request_seed_mixes_both_inputs() -> None:
    seeds = {request_seed(seed, step) for seed in range(50) for step in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= s < 2**63 for s in seeds)


def test_logprob_entries_rank_and_top() -> None:
    # vLLM's rank: the number of tokens at least as likely as the chosen one (ties count against it), 1 = best
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, -2.0], [5.0, 1.0, 1.0, 0.0, 2.0]])
    entries = logprob_entries(logits, [2, 0], [2, 0])
    reference = logits.log_softmax(-1)
    assert [e.rank for e in entries] == [3, 1]
    assert abs(entries[0].logprob - float(reference[0, 2])) < 1e-6
    assert entries[0].top_ids in ([1, 3], [3, 1]) and entries[1].top_ids == []
    tied = logprob_entries(logits, [3], [1])[0]
    assert tied.rank == 2  # tied with token 1 for the best
