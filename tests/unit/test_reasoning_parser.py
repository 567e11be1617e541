"""frontend/reasoning.py on fixed strings: the one-shot split, and streamed pieces (tags split across pieces, held
back, never split between reasoning and content) adding up to the same split."""

from __future__ import annotations

import pytest
from loraplex.frontend.constraints import Found
from loraplex.frontend.reasoning import (
    Reasoning,
    ReasoningParser,
    constraint_after_reasoning,
    request_reasoning,
)
from loraplex.protocol.structs import OutputConstraint

DEEPSEEK, QWEN3 = True, False  # starts_in_reasoning

CASES = [  # (starts_in_reasoning, output, reasoning_content, content)
    (DEEPSEEK, "plan the answer</think>\n\nThe answer.", "plan the answer", "\n\nThe answer."),
    (DEEPSEEK, "<think>plan</think>answer", "plan", "answer"),  # the model opened it again
    (DEEPSEEK, "still thinking, no end", "still thinking, no end", None),
    (DEEPSEEK, "</think>just the answer", None, "just the answer"),  # empty reasoning
    (DEEPSEEK, "a</think>b</think>c", "a", "b</think>c"),  # after the reasoning, tags are text
    (DEEPSEEK, "ends in a partial </thi", "ends in a partial </thi", None),
    (DEEPSEEK, "<thi", "<thi", None),
    (QWEN3, "<think>plan</think>\n\nanswer", "plan", "\n\nanswer"),
    (QWEN3, "no thinking here", None, "no thinking here"),
    (QWEN3, "pre <think>plan</think>post", "plan", "pre post"),
    (QWEN3, "<think>unfinished", "unfinished", None),
    (QWEN3, "<think></think>answer", None, "answer"),
    (QWEN3, "a partial <thin", None, "a partial <thin"),
    (QWEN3, "", None, None),
]


@pytest.mark.parametrize("starts_in_reasoning, output, reasoning, content", CASES)
def test_one_shot_split(starts_in_reasoning, output, reasoning, content):
    assert ReasoningParser(starts_in_reasoning).split(output) == (reasoning, content)


def stream(starts_in_reasoning: bool, pieces: list[str]) -> list[tuple[str, str]]:
    parser = ReasoningParser(starts_in_reasoning)
    return [*(parser.feed(p) for p in pieces), parser.flush()]


@pytest.mark.parametrize("starts_in_reasoning, output, reasoning, content", CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_streamed_pieces_add_up_to_the_split_and_never_carry_a_tag_piece(starts_in_reasoning, output, reasoning,
                                                                         content, size):
    pieces = [output[i : i + size] for i in range(0, len(output), size)]
    released = stream(starts_in_reasoning, pieces)
    assert "".join(r for r, _ in released) == (reasoning or "")
    assert "".join(c for _, c in released) == (content or "")
    # no piece carries part of a tag the split dropped: each released piece is a substring of its side
    for r, c in released:
        assert r in (reasoning or "") and c in (content or "")


def test_a_tag_split_across_pieces_is_held_then_dropped():
    parser = ReasoningParser(DEEPSEEK)
    assert parser.feed("plan </th") == ("plan ", "")  # "</th" held
    assert parser.feed("ink>ans") == ("", "ans")
    assert parser.feed("wer") == ("", "wer")
    assert parser.flush() == ("", "")
    parser = ReasoningParser(QWEN3)
    assert parser.feed("<") == ("", "")
    assert parser.feed("think>x</") == ("x", "")
    assert parser.feed("think>") == ("", "")
    assert parser.feed("y") == ("", "y")
    parser = ReasoningParser(DEEPSEEK)
    assert parser.feed("</thought") == ("</thought", "")  # not a tag after all: released at once


class FakeTokenizer:
    def __init__(self, ids: dict[str, list[int]]):
        self.ids = ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return self.ids[text]


def test_request_reasoning_and_the_constraint_after_it():
    single, split = FakeTokenizer({"</think>": [9]}), FakeTokenizer({"</think>": [4, 5, 6]})
    assert request_reasoning(None, None, single) is None
    assert request_reasoning("deepseek_r1", None, single) == Reasoning(starts_in_reasoning=True, end_ids=(9,))
    assert request_reasoning("qwen3", {"enable_thinking": True}, split) == Reasoning(False, (4, 5, 6))
    assert request_reasoning("qwen3", {"enable_thinking": False}, single) is None
    # GLM-4.5 opens <think> itself, as Qwen3 does, and its template closes an empty one when thinking is off
    assert request_reasoning("glm45", None, single) == Reasoning(starts_in_reasoning=False, end_ids=(9,))
    assert request_reasoning("glm45", {"enable_thinking": False}, single) is None
    assert request_reasoning("deepseek_r1", {"enable_thinking": False}, single).end_ids == (9,)
    # DeepSeek-V3.1: reasoning only with chat_template_kwargs.thinking (its template then opens <think>)
    assert request_reasoning("deepseek_v3", None, single) is None
    assert request_reasoning("deepseek_v3", {"thinking": False}, single) is None
    assert request_reasoning("deepseek_v3", {"thinking": True}, split) == Reasoning(True, (4, 5, 6))
    found = Found(OutputConstraint("regex", "[0-9]+"), "structured_outputs.regex")
    after = constraint_after_reasoning(found, Reasoning(True, (4, 5, 6)))
    assert after == Found(OutputConstraint("regex", "[0-9]+", start_after=(4, 5, 6)), "structured_outputs.regex")
    assert constraint_after_reasoning(found, None) is found
    assert constraint_after_reasoning(None, Reasoning(True, (9,))) is None
