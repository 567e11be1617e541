"""Speculative decoding in process: the real scheduler and a real worker (ModelRunner) in one loop. With a draft model
(DraftRunner, its KV on the target's pages), greedy outputs equal those without speculation, through prefill chunks,
prefix hits and many concurrent requests; a draft that is the target itself has every draft accepted. Draft adapters
(--speculative-lora-modules): in a batch of the base and two adapters, the adapter with a draft counterpart (the target
adapter itself, on a draft that is the target) has every draft accepted, where without it fewer are; outputs equal the
run without speculation. EAGLE-3 heads (random weights; a8 on its own) leave the same batch's greedy outputs as they
are. Penalties, logit controls, min_new_tokens and grammars are verified row by row: outputs and logprobs as without
speculation."""

from __future__ import annotations

import pytest
from loraplex.protocol.structs import OutputConstraint, SamplingParams
from loraplex.worker.model.config import ModelConfigError
from transformers import AutoTokenizer

from tests.builders import build_eagle3_head, build_tiny_model
from tests.lora_helpers import ADAPTER_IDS, LORA_CONFIG
from tests.speculative_helpers import MAX_NEW, MIXED_NAMES, generate, mixed_prompts
from tests.worker_helpers import make_runner, random_prompts


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller model with the target's tokenizer (one layer, another seed): it agrees with the target sometimes."""
    path = tmp_path_factory.mktemp("draft")
    build_tiny_model(path, num_layers=1, seed=5)
    return path


def test_greedy_with_a_draft_model_equals_greedy_without(llama_dir, draft_dir):
    prompts = random_prompts([5, 19, 9, 19], vocab_size=200, seed=3)
    prompts[3] = prompts[1][:16] + prompts[3][16:]  # a prefix hit on the second's pages
    reference, _ = generate(llama_dir, prompts)
    draft_model = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(draft_dir)}
    outputs, sched = generate(llama_dir, prompts, draft_model)
    assert outputs == reference
    [count] = sched.stats(op_id=0).spec
    assert count.num_verify_passes > 0 and count.num_draft_tokens > 0
    itself = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(llama_dir)}
    outputs, sched = generate(llama_dir, prompts, itself)
    assert outputs == reference
    [count] = sched.stats(op_id=0).spec
    assert count.num_accepted_tokens == count.num_draft_tokens > 0  # the target drafting for itself: all accepted


@pytest.fixture(scope="module")
def mixed(llama_dir, adapter_dirs) -> tuple[list[list[int]], dict, dict]:
    """(prompts, adapters, greedy outputs without speculation) of a batch mixing the base model and a4, a8."""
    adapters = {name: adapter_dirs[name] for name in ("a4", "a8")}
    prompts = mixed_prompts()
    reference, _ = generate(llama_dir, prompts, adapters=adapters, names=MIXED_NAMES)
    return prompts, adapters, reference


def test_a_draft_adapter_drafts_for_its_namesake(llama_dir, adapter_dirs, mixed):
    """The draft model is the target and a8's draft adapter is a8 itself: a8's drafts are all accepted, as the base's;
    a4 (no draft adapter) drafts with the bare draft and has some rejected; without a8's draft adapter so has a8."""
    prompts, adapters, reference = mixed
    itself = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(llama_dir)}
    acceptance = {}
    for draft_adapters in ([], [f"a8={adapter_dirs['a8']}"]):
        outputs, sched = generate(llama_dir, prompts, itself, adapters=adapters, names=MIXED_NAMES,
                                  speculative_lora_modules=draft_adapters)  # fmt: skip
        assert outputs == reference
        counts = {c.lora_id: c for c in sched.stats(op_id=0).spec}
        assert set(counts) == {None, ADAPTER_IDS["a4"], ADAPTER_IDS["a8"]}
        assert counts[None].num_accepted_tokens == counts[None].num_draft_tokens > 0
        a4 = counts[ADAPTER_IDS["a4"]]
        assert a4.num_accepted_tokens < a4.num_draft_tokens  # the bare draft model misses a4's changes
        acceptance[bool(draft_adapters)] = {lora_id: c.num_accepted_tokens / c.num_draft_tokens
                                            for lora_id, c in counts.items()}  # fmt: skip
    a8 = ADAPTER_IDS["a8"]
    assert acceptance[False][a8] < 1.0 and acceptance[True][a8] == 1.0, acceptance
    assert acceptance[True][ADAPTER_IDS["a4"]] == acceptance[False][ADAPTER_IDS["a4"]]


def test_greedy_with_an_eagle3_head_equals_greedy_without(llama_dir, mixed, tmp_path):
    """Any head's drafts leave greedy outputs as they are (verification decides): base and two adapters in one batch,
    a8 on a head of its own (--speculative-lora-modules), prefill chunks and a prefix hit; every request drafted."""
    prompts, adapters, reference = mixed
    build_eagle3_head(llama_dir, tmp_path / "head", draft_vocab_size=400, aux_layer_ids=(0, 1, 1), seed=3,
                      with_embedding=False)  # fmt: skip
    build_eagle3_head(llama_dir, tmp_path / "a8_head", draft_vocab_size=200, aux_layer_ids=(1, 0, 0), seed=4)
    eagle3 = {"method": "eagle3", "num_speculative_tokens": 3, "model": str(tmp_path / "head")}
    outputs, sched = generate(llama_dir, prompts, eagle3, adapters=adapters, names=MIXED_NAMES,
                              speculative_lora_modules=[f"a8={tmp_path / 'a8_head'}"])  # fmt: skip
    assert outputs == reference
    counts = {c.lora_id: c for c in sched.stats(op_id=0).spec}
    assert set(counts) == {None, ADAPTER_IDS["a4"], ADAPTER_IDS["a8"]}
    assert all(c.num_draft_tokens > 0 and c.num_verify_passes > 0 for c in counts.values())


def test_a_draft_adapter_that_does_not_load_stops_the_start_naming_it(llama_dir, tmp_path):
    itself = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(llama_dir)}
    with pytest.raises(ModelConfigError, match="draft adapter 'x'.*does not exist"):
        make_runner(llama_dir, speculative_config=itself, speculative_lora_modules=[f"x={tmp_path / 'absent'}"],
                    **LORA_CONFIG)  # fmt: skip


def test_penalties_logit_controls_and_grammars_verify_as_without_drafts(llama_dir, draft_dir):
    """Each verify row processed as its token's row without drafts: outputs and logprobs equal decoding without
    speculation, for the target drafting for itself (its unprocessed argmax: the penalties and the grammar reject some
    drafts) and another draft model."""
    prompts = [p + p for p in random_prompts([6, 5, 7, 4, 5], vocab_size=200, seed=7)]
    plain, _ = generate(llama_dir, prompts[1:2])
    no_e = OutputConstraint("regex", "[^e]*")  # refuses every token with an "e" in it
    eos = [AutoTokenizer.from_pretrained(llama_dir).eos_token_id]  # a grammar ends with a stop token
    sampling = [
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.7,
                       presence_penalty=0.4, logprobs=2),
        # its first tokens banned until the sixth (min_new_tokens), its second and third biased away
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, min_new_tokens=6, stop_token_ids=[plain["r0"][0]],
                       logit_bias={plain["r0"][1]: -5.0}, bad_words_ids=[[plain["r0"][1], plain["r0"][2]]],
                       logprobs=0),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, constraint=no_e, stop_token_ids=eos,
                       logprobs=1),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, constraint=no_e, stop_token_ids=eos,
                       frequency_penalty=1.0),
        SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0),
    ]  # fmt: skip
    ref_logprobs: dict = {}
    reference, _ = generate(llama_dir, prompts, sampling=sampling, logprobs=ref_logprobs)
    # (n-gram drafts reach the same verify rows; the random model's tokens rarely recur in these prompts)
    methods = {"itself": {"method": "draft_model", "num_speculative_tokens": 3, "model": str(llama_dir)},
               "draft": {"method": "draft_model", "num_speculative_tokens": 3, "model": str(draft_dir)}}  # fmt: skip
    for method, spec in methods.items():
        logprobs: dict = {}
        outputs, sched = generate(llama_dir, prompts, spec, sampling=sampling, logprobs=logprobs)
        assert outputs == reference, method
        assert logprobs.keys() == ref_logprobs.keys() == {"r0", "r1", "r2"}
        for rid, entries in logprobs.items():
            for ours, ref in zip(entries, ref_logprobs[rid], strict=True):
                assert ours.top_ids == ref.top_ids and ours.rank == ref.rank, (method, rid)
                assert abs(ours.logprob - ref.logprob) < 1e-4, (method, rid, ours, ref)
        [count] = sched.stats(op_id=0).spec
        assert count.num_draft_tokens > 0, (method, count)
        if method == "itself":  # accepted where the processing keeps the target's own argmax, else rejected
            assert 0 < count.num_accepted_tokens < count.num_draft_tokens, count
