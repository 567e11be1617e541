"""Qwen3.5 text (Gated DeltaNet + gated attention) in the worker against HF transformers in fp32: the chunked and
recurrent forms of the delta rule against the reference's, whole prompts in one batch, chunked prefill carrying the
state across passes beside decoding requests, a recomputed (preempted) request in a slot another left dirty, and the
state slot checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loraplex.protocol.structs import ForwardBatch, ForwardReq
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.layers.gated_delta import chunked_rule, l2norm, recurrent_rule
from loraplex.worker.model_runner import ModelRunner
from loraplex.worker.state_cache import HybridCache

from tests.hybrid_models import build_hybrid_model
from tests.reference import assert_greedy_match, hf_greedy, hf_model
from tests.worker_helpers import GREEDY, Seq, forward_logits, make_runner, random_prompts, run_greedy_schedule

FP32_TOL = 1e-4
LENGTHS = [5, 1, 70, 12, 3]  # one prompt of a single token (the decode path from a zero state), one past a chunk


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3_5_text")
    build_hybrid_model(out)
    return out


@pytest.fixture(scope="module")
def runner(hybrid_dir: Path) -> ModelRunner:
    return make_runner(hybrid_dir, max_running_requests=8)


@torch.inference_mode()
def hf_logits(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    return hf_model(str(model_dir))(torch.tensor([prompt])).logits[0]  # (len, vocab)


def _pages(lengths: list[int], page_size: int, first: int = 0) -> list[list[int]]:
    pages, next_page = [], first
    for n in lengths:
        num = -(-n // page_size)
        pages.append(list(range(next_page, next_page + num)))
        next_page += num
    return pages


@pytest.mark.parametrize("chunk_len", [64, 5])
def test_chunked_form_equals_the_recurrent_form_and_the_reference(chunk_len: int) -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as hf_chunked

    gen = torch.Generator().manual_seed(0)
    n, key_heads, value_heads, dk, dv = 150, 2, 4, 8, 6
    q, k = torch.randn(n, key_heads, dk, generator=gen), torch.randn(n, key_heads, dk, generator=gen)
    v = torch.randn(n, value_heads, dv, generator=gen)
    g, beta = -torch.rand(n, value_heads, generator=gen), torch.rand(n, value_heads, generator=gen)
    state = torch.randn(value_heads, dk, dv, generator=gen) * 0.1
    ref, ref_state = hf_chunked(q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
                                output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
    qn, kn = l2norm(q) * dk**-0.5, l2norm(k)
    out, final = chunked_rule(qn, kn, v, g, beta, state, chunk_len=chunk_len)
    out_rec, final_rec = recurrent_rule(qn, kn, v, g, beta, state)
    for ours, theirs in ((out, ref[0]), (final, ref_state[0]), (out_rec, out), (final_rec, final)):
        assert (ours - theirs).abs().max().item() < 1e-5


def test_cache_holds_kv_for_attention_layers_only(runner: ModelRunner) -> None:
    cache = runner.kv_cache
    assert isinstance(cache, HybridCache)
    assert cache.kv.shape[0] == 1  # one full-attention layer of four
    assert cache.conv.shape[:2] == (3, 8) and cache.recurrent.shape[:2] == (3, 8)  # 3 linear layers, 8 slots
    assert runner.num_state_slots == 8


def test_prompts_in_one_batch_match_hf(runner: ModelRunner, hybrid_dir: Path) -> None:
    prompts = random_prompts(LENGTHS, runner.vocab_size, seed=1)
    pages = _pages(LENGTHS, runner.page_size)
    reqs = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, state_slot=7 - i)
            for i, (p, pg) in enumerate(zip(prompts, pages, strict=True))]  # fmt: skip
    logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs))
    for prompt, ours in zip(prompts, logits.split(LENGTHS), strict=True):
        diff = (ours - hf_logits(hybrid_dir, prompt)).abs().max().item()
        assert diff <= FP32_TOL, f"prompt of {len(prompt)}: max abs logit diff {diff:.2e}"


def test_chunked_prefill_beside_decodes_matches_hf_greedy(runner: ModelRunner, hybrid_dir: Path) -> None:
    # Requests join mid-run and prefill in chunks of 5 or 7 while others decode: every state crosses passes.
    prompts = random_prompts([23, 9, 16], runner.vocab_size, seed=2)
    seqs = [Seq(prompt=p, prefill_chunk=c, state_slot=s) for p, c, s in zip(prompts, [5, 7, 100], [2, 0, 5],
                                                                            strict=True)]  # fmt: skip
    outputs = run_greedy_schedule(runner, seqs, start_steps=[0, 2, 3], max_new_tokens=6)
    num_compared = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        ref, margins = hf_greedy(hybrid_dir, prompt, 6)
        num_compared += assert_greedy_match(out, ref, margins, what=f"prompt of {len(prompt)}")
    assert num_compared >= 9


def test_recomputed_request_in_a_used_slot_matches_hf(runner: ModelRunner, hybrid_dir: Path) -> None:
    # A request runs a few passes in slot 3, is preempted, and is recomputed from position 0 in slot 3 again after
    # another request used it: the pass from position 0 starts the state from zero, so nothing of either leaks.
    prompt, other = random_prompts([14, 11], runner.vocab_size, seed=3)
    pages = list(range(40, 44))
    for chunk_start in (0, 6):
        chunk = prompt[chunk_start : chunk_start + 6]
        req = ForwardReq(input_ids=chunk, num_cached_tokens=chunk_start, page_ids=pages, sampling=GREEDY, state_slot=3)
        runner.forward(ForwardBatch(batch_id=0, reqs=[req]))
    runner.forward(ForwardBatch(batch_id=1, reqs=[
        ForwardReq(input_ids=other, num_cached_tokens=0, page_ids=[50, 51, 52], sampling=GREEDY, state_slot=3)]))
    req = ForwardReq(input_ids=prompt, num_cached_tokens=0, page_ids=pages, sampling=GREEDY, state_slot=3)
    ours = forward_logits(runner, ForwardBatch(batch_id=2, reqs=[req]))
    diff = (ours - hf_logits(hybrid_dir, prompt)).abs().max().item()
    assert diff <= FP32_TOL, f"max abs logit diff {diff:.2e}"


@pytest.mark.parametrize("slots", [[-1], [8], [1, 1]])
def test_bad_state_slots_fail_the_batch(runner: ModelRunner, slots: list[int]) -> None:
    reqs = [ForwardReq(input_ids=[1, 2], num_cached_tokens=0, page_ids=[90 + i], sampling=GREEDY, state_slot=s)
            for i, s in enumerate(slots)]  # fmt: skip
    with pytest.raises(BatchError, match="state slot"):
        runner.forward(ForwardBatch(batch_id=0, reqs=reqs))
