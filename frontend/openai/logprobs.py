"""The OpenAI answers' logprobs: completions' (tokens, text offsets, top entries; an echoed prompt's first),
chat's (content entries with bytes), and vLLM's prompt_logprobs, read from a request's state."""

from __future__ import annotations

from typing import NamedTuple

from loraplex.frontend.bodies import (
    ChatLogprob,
    ChatLogprobs,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
)
from loraplex.frontend.request_state import RequestState
from loraplex.protocol.structs import TokenLogprob


def top_entries(state: RequestState, token: str, lp: TokenLogprob) -> dict[str, float]:
    """Completions' top_logprobs of one token, as OpenAI and vLLM give it: the chosen token, then the `logprobs`
    best (up to logprobs + 1 entries; logprobs 0: the chosen token alone). Where two ids decode to the same text,
    the first of them keeps it, so the chosen token's value is always its own."""
    top = {token: lp.logprob}
    num_top = state.sampling.logprobs  # an echoed prompt token may hold more (prompt_logprobs above logprobs)
    for tid, value in zip(lp.top_ids[:num_top], lp.top_logprobs[:num_top], strict=True):
        top.setdefault(state.token_text(tid), value)
    return top


def prompt_logprobs(state: RequestState, num_top: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs of a finished state: null for the first token, then {token id: entry} with the prompt
    token first and the num_top best after it (a best one that is the prompt token is not repeated)."""
    def entry(token_id: int, value: float, rank: int) -> PromptLogprob:
        return PromptLogprob(logprob=value, rank=rank, decoded_token=state.token_text(token_id))

    out: PromptLogprobs = []
    for tid, lp in state.prompt_logprob_entries():
        if lp is None:
            out.append(None)
            continue
        position = {str(tid): entry(tid, lp.logprob, lp.rank)}
        for rank, (top_id, value) in enumerate(zip(lp.top_ids[:num_top], lp.top_logprobs[:num_top], strict=True), 1):
            position.setdefault(str(top_id), entry(top_id, value, rank))
        out.append(position)
    return out


class Echo(NamedTuple):
    """Completions' echo of one prompt: the text its choices begin with, and where each prompt token's text starts
    in it (filled when logprobs are asked)."""

    text: str
    offsets: list[int]


def completion_logprobs(state: RequestState, start: int, echo: Echo | None, with_prompt: bool) -> CompletionLogprobs:
    """The output tokens from `start` on in the completions shape, after the echoed prompt's when with_prompt.
    text_offset indexes the choice's whole text (the echoed prompt, then the output): a token that shows no text
    there (a BOS the prompt's text lacks, a skipped special token) spans nothing."""
    entries, offsets = [], []
    if with_prompt and echo is not None:
        entries = state.prompt_logprob_entries()
        offsets = echo.offsets[: len(entries)]
    base = len(echo.text) if echo is not None else 0
    outputs = zip(state.output_ids[start:], state.output_logprobs[start:], state.output_offsets[start:], strict=False)
    for tid, lp, offset in outputs:
        entries.append((tid, lp))
        offsets.append(base + offset)
    tokens, values, tops = [], [], []
    for tid, lp in entries:
        token = state.token_text(tid)
        tokens.append(token)
        values.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None else top_entries(state, token, lp))
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def chat_logprobs(state: RequestState, start: int) -> ChatLogprobs:
    def entry(tid: int, value: float) -> ChatTopLogprob:
        token = state.token_text(tid)
        return ChatTopLogprob(token=token, logprob=value, bytes=list(token.encode("utf-8")))

    content = []
    for lp, tid in zip(state.output_logprobs[start:], state.output_ids[start:], strict=False):
        chosen = entry(tid, lp.logprob)
        tops = [entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        content.append(ChatLogprob(token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes, top_logprobs=tops))
    return ChatLogprobs(content=content)
