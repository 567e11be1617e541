"""Speculative decoding's multi-token deltas in the frontend: a stop string ends the output where it would
one token a pass."""

from __future__ import annotations


def test_a_stop_string_inside_a_delta_of_several_tokens_drops_the_tokens_after_it(llama_dir):
    """Accepted drafts arrive as one delta: a stop string in its middle ends the output there, as one token a pass."""
    from loraplex.frontend.request_state import RequestState
    from loraplex.protocol.structs import SamplingParams, TokenDelta
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    ids = tokenizer(" the cat sat on the mat", add_special_tokens=False)["input_ids"]
    state = RequestState("r", [1], SamplingParams(max_new_tokens=32), ["sat"], tokenizer, None, None)
    assert state.apply(TokenDelta(rid="r", token_ids=ids))  # the scheduler must abort it
    one_by_one = RequestState("r", [1], SamplingParams(max_new_tokens=32), ["sat"], tokenizer, None, None)
    for token_id in ids:
        if one_by_one.apply(TokenDelta(rid="r", token_ids=[token_id])):
            break
    assert state.text == one_by_one.text and state.output_ids == one_by_one.output_ids
    assert len(state.output_ids) < len(ids) and len(state.token_times) == len(state.output_ids)
