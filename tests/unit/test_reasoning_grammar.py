"""The worker's grammar for a reasoning request: with `start_after`, no mask until the output ends with those ids (a
sequence, matched whole and consecutive), then the grammar from the next token; without it, masked from the first."""

from __future__ import annotations

import json

import pytest
import torch
from loraplex.protocol.structs import ForwardReq, OutputConstraint, SamplingParams
from loraplex.worker.grammar import GrammarMasks
from loraplex.worker.sampling_batch import SamplingBatch
from loraplex.worker.sampling_table import SamplingTable
from transformers import AutoTokenizer

from tests.worker_helpers import num_grammar_sequences


@pytest.fixture(scope="module")
def tokens(llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    ids = {text: tokenizer.convert_tokens_to_ids(text) for text in ("a", "b", "x", "1", "2")}
    return ids, tokenizer.eos_token_id


class OneRequest:
    """One constrained request driven step by step: each step the stand-in model favours one token strongly."""

    def __init__(self, llama_dir, constraint: OutputConstraint, eos: int):
        self.vocab_size = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
        self.grammar = GrammarMasks(str(llama_dir), self.vocab_size, rank=0, world_size=1)
        self.table = SamplingTable()
        self.sampling = SamplingParams(max_new_tokens=32, stop_token_ids=[eos], constraint=constraint)
        self.num_generated = 0

    def step(self, favoured: int) -> tuple[bool, int]:
        """(whether this step's logits were masked, the token sampled)."""
        fwd = ForwardReq(input_ids=[5], num_cached_tokens=3 + self.num_generated, page_ids=[],
                         sampling=self.sampling if self.num_generated == 0 else None,
                         num_generated=self.num_generated, req_key=7)
        batch = SamplingBatch.of([fwd], self.table.resolve([fwd]), self.vocab_size, torch.device("cpu"))
        logits = torch.zeros(1, self.vocab_size)
        logits[0, favoured] = 10.0
        masked = self.grammar.mask(logits, [fwd], batch)
        token = self.grammar.record([fwd], batch, [int(masked.argmax())])[0]
        self.num_generated += 1
        return bool(torch.isinf(masked).any()), token


def test_grammar_starts_after_the_end_of_reasoning_sequence(llama_dir, tokens):
    ids, eos = tokens
    end = (ids["a"], ids["b"])  # `</think>` as two tokens
    run = OneRequest(llama_dir, OutputConstraint("regex", "[12]+", start_after=end), eos)
    # Free while reasoning: the model's tokens go through, the end sequence split by another token does not count.
    for favoured in (ids["x"], ids["a"], ids["x"], ids["b"], ids["a"]):
        assert run.step(favoured) == (False, favoured)
    assert run.step(ids["b"]) == (False, ids["b"])  # a, b: the reasoning has ended with this token
    is_masked, token = run.step(ids["x"])  # the grammar now forbids what the model favours
    assert is_masked and token in (ids["1"], ids["2"])
    assert run.step(ids["2"]) == (True, ids["2"])
    run.grammar.end([7])
    assert num_grammar_sequences(run.grammar) == 0


def test_without_start_after_the_grammar_masks_from_the_first_token(llama_dir, tokens):
    ids, eos = tokens
    run = OneRequest(llama_dir, OutputConstraint("regex", "[12]+"), eos)
    is_masked, token = run.step(ids["x"])
    assert is_masked and token in (ids["1"], ids["2"])


def test_a_single_token_end(llama_dir, tokens):
    ids, eos = tokens
    run = OneRequest(llama_dir, OutputConstraint("regex", "[12]+", start_after=(ids["a"],)), eos)
    assert run.step(ids["x"]) == (False, ids["x"])
    assert run.step(ids["a"]) == (False, ids["a"])
    assert run.step(ids["x"])[0]
