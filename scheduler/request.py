"""Request: one generation request as the scheduler tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protocol.structs import SamplingParams, TokenizedGenerateReq


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"  # holds its pages and its adapter's slot
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    lora_id: int | None = None  # None = base model
    output_ids: list[int] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)  # reserved at admission for prompt + max_new_tokens
    num_cached_tokens: int = 0  # tokens whose KV the workers have written
    slot: int = -1  # adapter device slot while running, -1 = base model
    status: RequestStatus = RequestStatus.WAITING
    is_aborted: bool = False  # aborted while a forward pass that includes it was in flight: ends when it returns

    @classmethod
    def from_req(cls, req: TokenizedGenerateReq) -> Request:
        return cls(rid=req.rid, prompt_ids=list(req.input_ids), sampling=req.sampling, lora_id=req.lora_id)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_num_tokens(self) -> int:
        return len(self.prompt_ids) + self.sampling.max_new_tokens

    @property
    def num_remaining_tokens(self) -> int:
        """Output tokens still to come at most; every forward pass that includes the request yields one."""
        return self.sampling.max_new_tokens - len(self.output_ids)

    def num_pages_needed(self, page_size: int) -> int:
        return -(-self.max_num_tokens // page_size)

    def next_input_ids(self) -> list[int]:
        """Tokens the next forward pass writes to the KV cache: the uncached prompt, or the last sampled token."""
        if self.num_cached_tokens < len(self.prompt_ids):
            return self.prompt_ids[self.num_cached_tokens :]
        return self.output_ids[-1:]
