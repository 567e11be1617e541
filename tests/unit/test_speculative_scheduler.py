"""Speculative decoding in the scheduler, on plain ints: NgramProposer's drafts, and verify passes under random
traffic (acceptance and rejection, preemption, chunked prefill, prefix hits) giving exactly the outputs of decoding
without drafts, with every invariant checked each step and no page leaked."""

from __future__ import annotations

import random

import pytest
from loraplex.protocol.structs import OutputConstraint, SamplingParams, TokenizedGenerateReq
from loraplex.scheduler.ngram_proposer import NgramProposer

from tests.unit.test_scheduler_core import Workers, assert_drained, load, make_scheduler

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
DRAFT_MODEL = {"method": "draft_model", "num_speculative_tokens": 3, "model": "/draft"}


def test_proposer_takes_what_followed_the_longest_recurring_suffix():
    proposer = NgramProposer(1, 3, num_draft_tokens=3)
    assert proposer.propose([5, 6, 7, 8, 9, 5, 6, 7]) == [8, 9, 5]  # suffix 5 6 7 recurs: what followed it
    assert proposer.propose([5, 6, 7, 8, 9, 5, 6, 7], max_tokens=2) == [8, 9]
    assert proposer.propose([1, 2, 9, 1, 3, 9, 1]) == [3, 9, 1]  # 9 1 recurs at its latest: 3 followed it
    assert proposer.propose([1, 2, 3, 4]) == []  # nothing recurs
    assert proposer.propose([4]) == [] and proposer.propose([]) == []
    assert proposer.propose([7, 7]) == [7]  # the suffix's own tokens never count as an occurrence of it
    assert proposer.propose([1, 2, 3, 1, 2, 3], max_tokens=0) == []
    assert NgramProposer(2, 3, num_draft_tokens=3).propose([1, 2, 9, 1]) == []  # a one-token match is too short


def model_token(sched):
    """A deterministic model that repeats itself often (drafts accepted) and not always (drafts rejected): the next
    token is a function of the sequence so far, read from the scheduler's request and the pass's rows."""

    def next_token(rid, fwd) -> int:
        req = next(r for r in sched.running.values() if r.rid == rid)
        seq = req.token_ids[: fwd.num_cached_tokens] + fwd.input_ids
        if len(seq) % 7 == 0:
            return 40 + len(seq) % 5
        return seq[-3] if len(seq) >= 3 else 30

    return next_token


def spec_gen(rid, prompt, max_new, lora=None, **sampling):
    return TokenizedGenerateReq(rid=rid, input_ids=prompt, lora_id=lora,
                                sampling=SamplingParams(max_new_tokens=max_new, **sampling))  # fmt: skip


def test_a_verify_pass_writes_the_drafts_and_keeps_only_the_accepted_tokens_pages():
    sched = make_scheduler(num_pages=32, page_size=4, speculative_config=NGRAM)
    workers = Workers(sched, model_token(sched))
    sched.add_request(spec_gen("a", [1, 2, 3, 1, 2, 3], 12, temperature=0.0))
    workers.step()  # the prompt: 3 sampled (seq[-3] of length 6)
    batch = workers.step()  # 1 2 3 1 2 3 | 3: suffix "2 3"? no: "3 3" absent; "3" recurs at 5: drafts from there
    [fwd] = batch.reqs
    assert fwd.num_draft_tokens > 0 and len(fwd.input_ids) == 1 + fwd.num_draft_tokens
    workers.run_until_idle()
    stats = sched.stats(op_id=0)
    [count] = stats.spec
    assert count.lora_id is None and count.num_verify_passes > 0
    assert 0 < count.num_accepted_tokens < count.num_draft_tokens  # some accepted, some rejected
    assert len(workers.outputs["a"]) == 12
    assert_drained(sched)


@pytest.mark.parametrize(("sampling", "drafts"), [
    ({"temperature": 0.0, "presence_penalty": 0.5, "repetition_penalty": 1.2}, True),
    ({"temperature": 0.0, "min_new_tokens": 2, "logit_bias": {5: 1.0}}, True),
    ({"temperature": 0.0, "constraint": OutputConstraint("regex", "[0-9]+")}, True),
    ({"temperature": 1.0, "seed": 3, "constraint": OutputConstraint("regex", "[0-9]+")}, True),
    # only rank 0 masks: an unseeded draw would leave the ranks' shared generators apart
    ({"temperature": 1.0, "constraint": OutputConstraint("regex", "[0-9]+")}, False),
    ({"temperature": 0.0, "constraint": OutputConstraint("regex", "[0-9]+", start_after=(7,))}, False),
])  # fmt: skip
def test_which_sampling_drafts(sampling, drafts):
    """Penalties, logit controls, min_new_tokens and grammars are verified row by row (worker/speculative.py)."""
    sched = make_scheduler(num_pages=32, page_size=4, speculative_config=NGRAM)
    workers = Workers(sched, model_token(sched))
    sched.add_request(spec_gen("p", [1, 2, 3, 1, 2, 3], 8, **sampling))
    workers.run_until_idle()
    assert any(fwd.num_draft_tokens for batch in workers.batches for fwd in batch.reqs) == drafts
    assert_drained(sched)


def test_hybrid_models_decode_without_drafts():
    sched = make_scheduler(num_pages=32, page_size=4, speculative_config=NGRAM, num_state_slots=4)
    assert sched.proposer is None


def sloppy_draft(sched):
    """A draft model that agrees with model_token but at every fifth position."""
    model = model_token(sched)

    def draft_token(rid, fwd) -> int:
        token = model(rid, fwd)
        return token + 1 if (fwd.num_cached_tokens + len(fwd.input_ids)) % 5 == 0 else token

    return draft_token


@pytest.mark.parametrize(("seed", "spec"), [(s, NGRAM) for s in range(4)] + [(s, DRAFT_MODEL) for s in range(2)])
def test_random_traffic_with_drafts_gives_the_outputs_without(seed, spec):
    rng = random.Random(seed)
    traffic = []
    for step in range(30):
        for _ in range(rng.randint(0, 2)):
            prompt = [rng.choice([1, 2, 3, 4]) for _ in range(rng.randint(1, 18))]
            stop = [rng.choice([40, 41, 42])] if rng.random() < 0.3 else []
            traffic.append((step, f"r{len(traffic)}", prompt, rng.randint(1, 20), rng.choice([None, 0, 1]), stop))

    def run(speculative_config, **options):
        sched = make_scheduler(page_size=4, num_slots=2, context_length=64, speculative_config=speculative_config,
                               **options)  # fmt: skip
        load(sched, 0, 1)
        workers = Workers(sched, model_token(sched), sloppy_draft(sched))
        for step in range(30):
            for _, rid, prompt, max_new, lora, stop in [t for t in traffic if t[0] == step]:
                workers.record(sched.add_request(spec_gen(rid, prompt, max_new, lora, temperature=0.0,
                                                          stop_token_ids=stop)))  # fmt: skip
            workers.step()
        workers.run_until_idle()
        assert_drained(sched)
        return dict(workers.outputs), sched

    reference, _ = run(None, num_pages=400, max_running=64)
    pressure = dict(num_pages=rng.randint(12, 20), max_running=rng.randint(2, 8),
                    chunked_prefill_size=rng.randint(3, 12), max_prefill=64, prefix_cache=True)  # fmt: skip
    outputs, sched = run(spec, **pressure)
    assert outputs == reference
    assert sched.num_preemptions > 0  # rolled-back and recomputed requests among them
    counts = {c.lora_id: c for c in sched.stats(op_id=0).spec}
    assert sum(c.num_accepted_tokens for c in counts.values()) > 0
    assert any(c.num_accepted_tokens < c.num_draft_tokens for c in counts.values())
    roomy, _ = run(spec, num_pages=400, max_running=64, prefix_cache=True)
    assert roomy == reference


def test_a_request_whose_drafts_keep_missing_backs_off():
    """Drafts never accepted: after m misses in a row the request decodes 2^m passes without drafts (up to a cap),
    keeping the overlap of passes; its outputs stay those of the model."""
    sched = make_scheduler(num_pages=64, page_size=4, speculative_config=DRAFT_MODEL)
    model = model_token(sched)
    workers = Workers(sched, model, lambda rid, fwd: model(rid, fwd) + 1)  # a draft model that is always wrong
    sched.add_request(spec_gen("a", [1, 2, 3], 40, temperature=0.0))
    workers.run_until_idle()
    [count] = sched.stats(op_id=0).spec
    assert count.num_accepted_tokens == 0 and 3 <= count.num_verify_passes <= 6
    assert len(workers.outputs["a"]) == 40
    assert_drained(sched)
