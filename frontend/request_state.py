"""RequestState: one generation request as the frontend sees it — token ids in, text out, finish reason."""

from __future__ import annotations

import asyncio
import bisect
import time
from dataclasses import dataclass
from typing import Any

from loraplex.frontend.detokenizer import IncrementalDetokenizer, StopMatcher
from loraplex.protocol.structs import SamplingParams, TokenDelta, TokenLogprob


@dataclass(frozen=True)
class OutputOptions:
    """How the frontend turns tokens into text (nothing the scheduler or the workers need)."""

    skip_special_tokens: bool = True
    # no_stop_trim / include_stop_str_in_output: a matched stop string stays in the text, and so does the text of a
    # special stop token (a stop token that is not special always stays)
    keep_stop: bool = False


class RequestState:
    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        stop_strings: list[str],
        tokenizer: Any,
        lora_name: str | None,
        lora_id: int | None,
        output: OutputOptions = OutputOptions(),
    ):
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.lora_name = lora_name
        self.lora_id = lora_id
        self.output = output
        self.dp_rank = 0  # the data-parallel replica serving it (frontend/cluster/router.py)
        self.key_id: str | None = None  # the API key it came with (frontend/caller.py): its output is charged there
        self.detokenizer = IncrementalDetokenizer(tokenizer, output.skip_special_tokens)
        self.stop_matcher = StopMatcher(stop_strings)
        self.output_ids: list[int] = []
        self.output_offsets: list[int] = []  # per output id, where its text starts in full_text
        self.num_cached_prompt_tokens = 0  # its prompt tokens the prefix cache held (usage's cached_tokens)
        self.output_logprobs: list[TokenLogprob] = []  # one per output id when sampling.logprobs >= 0
        # prompt positions max(logprob_start_len, 1) on, as they arrive (position 0 has none)
        self.input_logprobs: list[TokenLogprob] = []
        self.pooled = b""  # a pooling request's output (float32 bytes), once it finished
        self.return_text_in_logprobs = False  # native: fill the text of each logprob entry
        self.full_text = ""  # everything decoded so far
        self.text = ""  # what may be shown: stop strings cut, a possible stop prefix held back
        self.finish_reason: dict | None = None
        self.error: str | None = None
        self.error_status = 500
        self.changed = asyncio.Event()
        self.created_at = time.monotonic()
        self.first_token_at: float | None = None
        self.token_times: list[float] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, delta: TokenDelta) -> bool:
        """Take a scheduler delta; True if a stop string ended the request here (the scheduler must abort it)."""
        if self.finished:
            return False
        self.num_cached_prompt_tokens += delta.num_cached_prompt_tokens  # nonzero in its first delta only
        now = time.monotonic()
        if delta.token_ids and self.first_token_at is None:
            self.first_token_at = now
        self.token_times.extend([now] * len(delta.token_ids))
        self.output_ids.extend(delta.token_ids)
        self.pooled = self.pooled or delta.pooled
        self.output_logprobs.extend(delta.logprobs)
        self.input_logprobs.extend(delta.prompt_logprobs)
        old_len = len(self.full_text)
        num_shown = len(self._shown_ids(delta))
        for i, token_id in enumerate(delta.token_ids):  # one at a time, so each token's text starts where it did
            self.output_offsets.append(len(self.full_text))
            if i < num_shown:
                self.full_text += self.detokenizer.push([token_id])
        if delta.finish_reason is not None:
            self.full_text += self.detokenizer.flush()
        # Stop strings count only once the output has more than min_new_tokens tokens (vLLM's min_tokens); the first
        # search after that still sees a stop string that began in the text before.
        may_stop = len(self.output_ids) > self.sampling.min_new_tokens
        hit = self.stop_matcher.find(self.full_text, old_len) if may_stop else None
        if hit is not None:
            index, matched = hit
            self._drop_tokens_after(index + len(matched), len(self.output_ids) - len(delta.token_ids))
            self.text = self.full_text[: index + (len(matched) if self.output.keep_stop else 0)]
            self.finish_reason = {"type": "stop", "matched": matched}
            self.changed.set()
            return delta.finish_reason is None
        if delta.finish_reason is None:
            self.text = self.full_text[: self.stop_matcher.safe_len(self.full_text)]
        else:
            self.text = self.full_text
            self._finish_from_scheduler(delta)
        self.changed.set()
        return False

    def _drop_tokens_after(self, text_end: int, num_before: int) -> None:
        """A stop string ending at text_end: the tokens whose text starts after it are not output. Only a delta of
        several tokens (speculative decoding's accepted drafts) has such tokens, and they are dropped as decoding
        one token a pass would never have made them."""
        num_kept = max(bisect.bisect_left(self.output_offsets, text_end), num_before)
        for kept in (self.output_ids, self.output_logprobs, self.token_times, self.output_offsets):
            del kept[num_kept:]

    def _shown_ids(self, delta: TokenDelta) -> list[int]:
        """The delta's tokens whose text is shown: a special token that stopped generation is not (it stays in
        output_ids), unless the request keeps its stop."""
        ids = delta.token_ids
        if delta.finish_reason == "stop" and ids and not self.output.keep_stop:
            if ids[-1] in self.detokenizer.tokenizer.all_special_ids:
                return ids[:-1]
        return ids

    def _finish_from_scheduler(self, delta: TokenDelta) -> None:
        reason = delta.finish_reason
        if reason == "stop":
            self.finish_reason = {"type": "stop", "matched": self.output_ids[-1] if self.output_ids else None}
        elif reason == "length":
            self.finish_reason = {"type": "length", "length": len(self.output_ids)}
        elif reason == "abort":
            self.finish_reason = {"type": "abort", "message": delta.error_message or "aborted"}
        else:
            self.fail(delta.error_message or "generation failed")

    def abort(self, message: str) -> None:
        """End it here with finish reason abort (not an error): what it produced so far is its answer."""
        if self.finished:
            return
        self.finish_reason = {"type": "abort", "message": message}
        self.changed.set()

    def fail(self, message: str, status: int = 500) -> None:
        if self.finished:
            return
        self.error = message
        self.error_status = status
        self.finish_reason = {"type": "abort", "message": message}
        self.changed.set()

    @property
    def wants_logprobs(self) -> bool:
        return self.sampling.logprobs >= 0

    def token_text(self, token_id: int) -> str:
        return self.detokenizer.tokenizer.decode([token_id])

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling.logprob_start_len >= 0

    def prompt_logprob_entries(self, start: int = 0) -> list[tuple[int, TokenLogprob | None]]:
        """(token id, logprob data or None for position 0) of the prompt positions from logprob_start_len on that
        have arrived, from the start-th of them."""
        first = self.sampling.logprob_start_len
        entries: list[tuple[int, TokenLogprob | None]] = [(self.prompt_ids[0], None)] if first == 0 else []
        first = max(first, 1)
        entries += zip(self.prompt_ids[first : first + len(self.input_logprobs)], self.input_logprobs, strict=True)
        return entries[start:]

    @property
    def num_prompt_logprob_entries(self) -> int:
        return len(self.input_logprobs) + (self.sampling.logprob_start_len == 0)

    def meta_info(self, logprobs_from: int = 0, input_logprobs_from: int = 0) -> dict:
        """logprobs_from / input_logprobs_from: the first output token / prompt logprob entry included (a stream
        chunk's own)."""
        info = {
            "id": self.rid,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.num_cached_prompt_tokens,
            "finish_reason": self.finish_reason,
        }
        if self.wants_logprobs:
            text = self.token_text if self.return_text_in_logprobs else (lambda _: None)
            entries = list(zip(self.output_logprobs[logprobs_from:], self.output_ids[logprobs_from:], strict=False))
            info["output_token_logprobs"] = [[lp.logprob, tid, text(tid)] for lp, tid in entries]
            if self.sampling.logprobs > 0:
                info["output_top_logprobs"] = [
                    [[v, t, text(t)] for v, t in zip(lp.top_logprobs, lp.top_ids, strict=True)] for lp, _ in entries
                ]
            if self.wants_prompt_logprobs:
                prompt = self.prompt_logprob_entries(input_logprobs_from)
                info["input_token_logprobs"] = [
                    [None if lp is None else lp.logprob, tid, text(tid)] for tid, lp in prompt
                ]
                if self.sampling.logprobs > 0:
                    info["input_top_logprobs"] = [
                        None if lp is None else [[v, t, text(t)] for v, t in zip(lp.top_logprobs, lp.top_ids,
                                                                                     strict=True)]
                        for _, lp in prompt
                    ]
        return info
