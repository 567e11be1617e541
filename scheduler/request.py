"""Request: one generation request as the scheduler tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from loraplex.protocol.mathutil import cdiv
from loraplex.protocol.structs import ImageInput, SamplingParams, TokenizedGenerateReq

# Stands in a request's page table for a page it gave back (wholly outside every layer's sliding window): the workers
# never attend to it, and it is any valid page id so the table keeps one entry per page of positions.
FREED_PAGE = 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # new, or preempted (its pages given back; it is recomputed when it runs again)
    RUNNING = "running"  # holds pages for the tokens it has, and its adapter's slot
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    lora_id: int | None = None  # None = base model
    lora_scale: float = 1.0  # its adapter's strength (part of its prefix-cache keys when not 1)
    arrival: int = 0  # order of arrival: the queue's order, and preemption takes the newest first
    priority: int = 0  # --scheduling-policy priority: lower runs first
    key_id: str | None = None  # the API key it came with (fair sharing counts per key and adapter)
    output_ids: list[int] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)  # pages for the tokens whose KV is written or being written
    num_freed_pages: int = 0  # its first pages, given back (FREED_PAGE in page_ids): outside every layer's window
    num_cached_tokens: int = 0  # tokens whose KV the workers have written
    num_scheduled_tokens: int = 0  # ... or are writing, in a pass in flight (>= num_cached_tokens)
    num_pending_samples: int = 0  # tokens that passes in flight will sample for it (not in output_ids yet)
    num_passes_in_flight: int = 0
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full pages, computed so far
    num_offered_pages: int = 0  # full written pages already offered to the prefix cache
    num_preemptions: int = 0
    num_hit_tokens_to_send: int = 0  # prompt tokens its first admission found cached, until its first delta says so
    slot: int = -1  # adapter device slot while running, -1 = base model
    state_slot: int = -1  # hybrid models: its linear-attention state slot while running, else -1
    restore_snapshot: int = -1  # ... the snapshot at its prefix-cache hit's end, until its first pass restores it
    snapshot_positions: list[int] = field(default_factory=list)  # ... boundaries it is still to save its states at
    status: RequestStatus = RequestStatus.WAITING
    is_aborted: bool = False  # aborted while a forward pass that includes it was in flight: ends when it returns
    # Its next pass tells the workers its sampling parameters, and its cached tokens if penalties read them: the first
    # pass after each admission (the workers keep both by req_key meanwhile).
    sends_state: bool = False
    is_on_workers: bool = False  # the workers keep state for it: released (released_keys) when it ends
    prompt_logprob_next: int = 0  # the first prompt position whose logprob is still to be delivered
    is_long_rope: bool = False  # longrope models: its KV is written with the long factors (set at each admission)
    is_pooling: bool = False  # the pooling runner's: prefill only, it ends with its prompt's last pass (no sample)
    token_type_ids: list[int] = field(default_factory=list)  # an encoder's segment of each prompt token; []: all 0
    # A vision-language model's prompt: its images over their placeholder runs, and its M-RoPE positions (3 rows of
    # len(prompt_ids); []: 1-D), a token at index i >= len(prompt_ids) sitting at i + mrope_delta in every row
    images: list[ImageInput] = field(default_factory=list)
    mrope_positions: list[list[int]] = field(default_factory=list)
    mrope_delta: int = 0
    # Speculative decoding's back-off: verify passes in a row that accepted nothing, and the decode passes it still
    # takes without drafts because of them (they keep the overlap of passes that drafting gives up)
    num_draft_misses: int = 0
    num_passes_without_drafts: int = 0

    def __post_init__(self) -> None:
        # Position 0 has no logprob (nothing predicts it): the frontend puts its null.
        self.prompt_logprob_next = max(self.sampling.logprob_start_len, 1)

    @classmethod
    def from_req(cls, req: TokenizedGenerateReq, arrival: int) -> Request:
        return cls(rid=req.rid, prompt_ids=list(req.input_ids), sampling=req.sampling, lora_id=req.lora_id,
                   lora_scale=req.lora_scale, arrival=arrival, priority=req.priority, key_id=req.key_id,
                   is_pooling=req.pooling, token_type_ids=list(req.token_type_ids), images=list(req.images),
                   mrope_positions=req.mrope_positions, mrope_delta=req.mrope_delta)

    @property
    def client(self) -> tuple[str | None, int | None]:
        """Whose share it counts in (FairShare): its API key's and its adapter's."""
        return self.key_id, self.lora_id

    @property
    def live_page_ids(self) -> list[int]:
        """The pages it holds (its page table less the ones it gave back)."""
        return self.page_ids[self.num_freed_pages :]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Output tokens still to come at most; every forward pass that includes the request yields one."""
        return self.sampling.max_new_tokens - len(self.output_ids)

    @property
    def num_unscheduled_tokens(self) -> int:
        """Tokens no pass has been given yet: the (rest of the) prompt, or the token a pass in flight will sample."""
        return self.num_tokens + self.num_pending_samples - self.num_scheduled_tokens

    @property
    def wants_more(self) -> bool:
        """Could a further pass still sample a token for it? (False once the samples in flight reach its limit.)"""
        if self.num_scheduled_tokens < self.num_tokens:  # prompt left (max_new_tokens 0 runs for prompt logprobs)
            return True
        return len(self.output_ids) + self.num_pending_samples < self.sampling.max_new_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling.logprob_start_len >= 0 and self.prompt_logprob_next < len(self.prompt_ids)

    def prompt_logprob_span(self, num_new: int) -> tuple[int, int]:
        """Prompt positions [start, end) whose logprobs a pass writing num_new tokens from num_scheduled_tokens
        computes (the logits at position p give the logprob of the token at p + 1); empty when none."""
        if not self.wants_prompt_logprobs:
            return 0, 0
        start = max(self.num_scheduled_tokens + 1, self.prompt_logprob_next)
        return start, max(start, min(self.num_scheduled_tokens + num_new + 1, len(self.prompt_ids)))

    @property
    def image_runs(self) -> list[tuple[int, int, str]]:
        """Its images' (offset, num_tokens, content hash): what its prefix-cache keys take beyond the tokens."""
        return [(image.offset, image.num_tokens, image.content_hash) for image in self.images]

    def images_in(self, start: int, num_tokens: int) -> list[ImageInput]:
        """The images whose placeholder runs overlap positions [start, start + num_tokens)."""
        end = start + num_tokens
        return [image for image in self.images if image.offset < end and image.offset + image.num_tokens > start]

    def mrope_rows(self, start: int, num_tokens: int) -> list[list[int]]:
        """M-RoPE positions of positions [start, start + num_tokens): [] for a pass wholly past the prompt (the
        workers take index + mrope_delta), else 3 rows, a recomputed output token's at index + mrope_delta."""
        num_prompt = len(self.prompt_ids)
        if not self.mrope_positions or start >= num_prompt:
            return []
        end = start + num_tokens
        past = list(range(num_prompt + self.mrope_delta, end + self.mrope_delta)) if end > num_prompt else []
        return [row[start:end] + past for row in self.mrope_positions]

    def num_pages_for(self, num_tokens: int, page_size: int) -> int:
        return cdiv(num_tokens, page_size)

    def next_input_ids(self, num_new: int) -> list[int]:
        """The next num_new known tokens for a pass, from the first one no pass has been given."""
        return self.token_ids[self.num_scheduled_tokens : self.num_scheduled_tokens + num_new]


def image_error(req: TokenizedGenerateReq) -> str:
    """Why a request's images or M-RoPE positions do not fit its prompt, or "" when they do (the frontend makes them
    right; checked again so that no sender can make a worker fail)."""
    end = 0
    for k, image in enumerate(req.images):
        if image.num_tokens < 1 or image.offset < end or image.offset + image.num_tokens > len(req.input_ids):
            return (f"image {k}'s placeholder run [{image.offset}, {image.offset + image.num_tokens}) is not inside "
                    f"the prompt of {len(req.input_ids)} tokens after the image before it")  # fmt: skip
        if len(set(req.input_ids[image.offset : image.offset + image.num_tokens])) != 1:
            return f"image {k}'s placeholder run holds tokens other than its placeholder"
        end = image.offset + image.num_tokens
    rows = req.mrope_positions
    if rows and (len(rows) != 3 or any(len(row) != len(req.input_ids) for row in rows)):
        return f"M-RoPE positions must be 3 rows of the prompt's {len(req.input_ids)} tokens"
    return ""
