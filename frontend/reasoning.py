"""Reasoning parsers (--reasoning-parser, vLLM's and SGLang's names): a chat answer's `<think>…</think>` text goes to
`reasoning_content` and the rest to `content`, whole or streamed; and a structured-output constraint of the request
applies only after the reasoning, from the token after the `</think>` ids (worker/grammar.py waits for them).

deepseek_r1: the chat template already opened `<think>`, so the output starts inside the reasoning (a `<think>` the
model writes first anyway is dropped); without `</think>` everything is reasoning. qwen3: reasoning only between a
`<think>` the output writes and its `</think>`; text before `<think>`, or an output without it, is content; with
`chat_template_kwargs.enable_thinking` false, no reasoning (the template closed it). glm45 (GLM-4.5 / 4.6) reads as
qwen3: the model opens `<think>` itself, and its template closes an empty one when thinking is off.
deepseek_v3 (DeepSeek-V3.1 / V3.2): reasoning only with `chat_template_kwargs.thinking` true (its template then opens
`<think>`, and the output reads as deepseek_r1's); off by default, where the template closes it and all is content.
openai_gptoss (gpt-oss): no tags, harmony channels (frontend/harmony.py): the analysis channel is reasoning, the final
channel content, and a call stays in the content as written for the `openai` tool-call parser; a constraint applies
after `<|channel|>final<|message|>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from loraplex.frontend.constraints import Found
from loraplex.frontend.harmony import CHANNEL, MESSAGE, split_reasoning

START_TAG, END_TAG = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3", "glm45", "openai_gptoss", "deepseek_v3")
HARMONY_FINAL = CHANNEL + "final" + MESSAGE  # where gpt-oss's answer starts

_BEFORE, _REASONING, _CONTENT = "before", "reasoning", "content"  # where the text read so far stands


class ReasoningParser:
    """One choice's text, split into (reasoning, content) as it arrives. A tag is never split between the two: a text
    that ends with the beginning of a tag is held back until the next piece (or the end) decides."""

    def __init__(self, starts_in_reasoning: bool):
        self._state = _REASONING if starts_in_reasoning else _BEFORE
        self._at_start = starts_in_reasoning  # a leading START_TAG is dropped
        self._held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        """The next piece of text -> the (reasoning, content) text it releases."""
        text, self._held = self._held + piece, ""
        reasoning, content = [], []
        while text:
            if self._state == _CONTENT:
                content.append(text)
                break
            if self._at_start:
                if len(text) < len(START_TAG) and START_TAG.startswith(text):
                    self._held = text  # may still become the opening tag
                    break
                text = text.removeprefix(START_TAG)
                self._at_start = False
                continue
            is_reasoning = self._state == _REASONING
            tag, out = (END_TAG, reasoning) if is_reasoning else (START_TAG, content)
            at = text.find(tag)
            if at >= 0:
                out.append(text[:at])
                text = text[at + len(tag) :]
                self._state = _CONTENT if is_reasoning else _REASONING
                continue
            keep = _partial_tag_len(text, tag)
            out.append(text[: len(text) - keep])
            self._held = text[len(text) - keep :]
            break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """At the end of the output: the held text, where it stands (a partial tag is text after all)."""
        held, self._held = self._held, ""
        return (held, "") if self._state == _REASONING else ("", held)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output -> (reasoning_content, content), None for an empty part (as vLLM answers)."""
        reasoning, content = self.feed(text)
        rest_reasoning, rest_content = self.flush()
        return (reasoning + rest_reasoning) or None, (content + rest_content) or None


class HarmonyReasoningParser:
    """openai_gptoss: ReasoningParser's feed / flush / split over harmony channels. The text so far is read whole at
    each piece; what it adds to the reading before goes out (a reading only ever extends the one before)."""

    def __init__(self) -> None:
        self._text = ""
        self._sent = (0, 0)  # reasoning, content characters released

    def feed(self, piece: str) -> tuple[str, str]:
        self._text += piece
        return self._release(final=False)

    def flush(self) -> tuple[str, str]:
        return self._release(final=True)

    def split(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = split_reasoning(text, final=True)
        return reasoning or None, content or None

    def _release(self, final: bool) -> tuple[str, str]:
        reasoning, content = split_reasoning(self._text, final)
        sent_reasoning, sent_content = self._sent
        self._sent = (len(reasoning), len(content))
        return reasoning[sent_reasoning:], content[sent_content:]


def _partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag (shorter than tag)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass(frozen=True)
class Reasoning:
    """A chat request's reasoning: where its output starts, and the token ids that end the reasoning."""

    starts_in_reasoning: bool
    end_ids: tuple[int, ...]
    harmony: bool = False  # openai_gptoss: channels, not tags; its special tokens must stay in the text

    @property
    def needs_special_tokens(self) -> bool:
        return self.harmony

    def parser(self) -> ReasoningParser | HarmonyReasoningParser:
        return HarmonyReasoningParser() if self.harmony else ReasoningParser(self.starts_in_reasoning)


def request_reasoning(parser_name: str | None, template_kwargs: dict[str, Any] | None,
                      tokenizer: Any) -> Reasoning | None:  # fmt: skip
    """The request's Reasoning under --reasoning-parser, or None: no parser, qwen3 / glm45 with thinking turned off, or
    deepseek_v3 without it turned on."""
    kwargs = template_kwargs or {}
    if parser_name is None:
        return None
    if parser_name in ("qwen3", "glm45") and kwargs.get("enable_thinking", True) is False:
        return None
    if parser_name == "deepseek_v3" and not kwargs.get("thinking", False):
        return None
    if parser_name == "openai_gptoss":
        return Reasoning(False, tuple(tokenizer.encode(HARMONY_FINAL, add_special_tokens=False)), harmony=True)
    # `</think>` is one added token in DeepSeek-R1's and Qwen3's tokenizers; elsewhere the worker matches the sequence
    end_ids = tuple(tokenizer.encode(END_TAG, add_special_tokens=False))
    return Reasoning(starts_in_reasoning=parser_name in ("deepseek_r1", "deepseek_v3"), end_ids=end_ids)


def constraint_after_reasoning(found: Found | None, reasoning: Reasoning | None) -> Found | None:
    """The request's constraint, applied from the token after the reasoning ends (unchanged without reasoning)."""
    if found is None or reasoning is None:
        return found
    constraint = msgspec.structs.replace(found.constraint, start_after=reasoning.end_ids)
    return Found(constraint, found.field)
