"""Incremental detokenization that never emits half a UTF-8 character, and stop-string matching."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding a window that starts a few tokens back keeps merges (leading spaces, multi-token characters) right;
    a window that ends in U+FFFD is held back until the next token completes the character.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: list[int]) -> str:
        self.token_ids.extend(new_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is held back, at the end of generation (an incomplete character stays U+FFFD)."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text) :]


def text_offsets(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool) -> list[int]:
    """Where each token's text starts in the text the ids decode to (as IncrementalDetokenizer builds it): a token
    that adds no text (a skipped special token, the first bytes of a character) spans nothing."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    offsets, num_chars = [], 0
    for token_id in token_ids:
        offsets.append(num_chars)
        num_chars += len(detokenizer.push([token_id]))
    return offsets


class StopMatcher:
    """Finds stop strings in generated text; holds back a tail that could still become one,
    so streamed and non-streamed output agree."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.max_len = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, new_from: int) -> tuple[int, str] | None:
        """(index, matched stop) of the earliest stop string ending in text[new_from:], if any."""
        if not self.stops:
            return None
        start = max(0, new_from - self.max_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            i = text.find(stop, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def safe_len(self, text: str) -> int:
        """Length of the prefix of text that can be emitted now."""
        for keep in range(min(self.max_len - 1, len(text)), 0, -1):
            tail = text[-keep:]
            if any(stop.startswith(tail) for stop in self.stops):
                return len(text) - keep
        return len(text)
