"""RequestState: one generation request as the frontend sees it — token ids in, text out, finish reason."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from frontend.detokenizer import IncrementalDetokenizer, StopMatcher
from protocol.structs import SamplingParams, TokenDelta, TokenLogprob


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
    ):
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.lora_name = lora_name
        self.lora_id = lora_id
        self.dp_rank = 0  # the data-parallel replica serving it (frontend/router.py)
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop_matcher = StopMatcher(stop_strings)
        self.output_ids: list[int] = []
        self.output_logprobs: list[TokenLogprob] = []  # one per output id when sampling.logprobs >= 0
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
        now = time.monotonic()
        if delta.token_ids and self.first_token_at is None:
            self.first_token_at = now
        self.token_times.extend([now] * len(delta.token_ids))
        self.output_ids.extend(delta.token_ids)
        self.output_logprobs.extend(delta.logprobs)
        old_len = len(self.full_text)
        self.full_text += self.detokenizer.push(delta.token_ids)
        if delta.finish_reason is not None:
            self.full_text += self.detokenizer.flush()
        hit = self.stop_matcher.find(self.full_text, old_len)
        if hit is not None:
            index, matched = hit
            self.text = self.full_text[:index]
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

    def meta_info(self, logprobs_from: int = 0) -> dict:
        """logprobs_from: the first output token whose logprob entries are included (a stream chunk's own)."""
        info = {
            "id": self.rid,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
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
        return info
