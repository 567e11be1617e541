"""SamplingBatch: one pass's sampling parameters row by row, and the tensors made of them, built once per batch.

Penalties, grammar masks, the sampler and logprobs all read this one build: the per-row values are gathered from the
parameters once, and the float columns reach the device in one copy."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from loraplex.protocol.structs import ForwardReq, SamplingParams

# The columns of SamplingBatch.values, in order.
_IS_GREEDY, _TEMPERATURE, _TOP_P, _MIN_P, _REPETITION, _FREQUENCY, _PRESENCE = range(7)


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature <= 0.0


@dataclass(frozen=True, eq=False)
class SamplingBatch:
    params: list[SamplingParams]  # per row
    num_generated: list[int]  # per row: output tokens so far (with the seed, it picks the row's generator)
    req_keys: list[int]  # per row
    is_greedy: list[bool]  # per row
    penalty_rows: list[int]  # rows that use a penalty
    history_rows: list[int]  # rows whose token history is kept and read (penalties, bad words of several tokens)
    constrained_rows: list[int]  # rows under structured output
    logprob_rows: list[int]  # rows that ask for the sampled token's logprob
    # (rows, token ids) not to be sampled at this step: min_new_tokens' stop tokens, one-token bad words
    banned: tuple[list[int], list[int]]
    bias: tuple[list[int], list[int], list[float]]  # logit_bias: (rows, token ids, values added)
    allowed: tuple[list[int], list[int]]  # allowed_token_ids: (rows, token ids), the rest of those rows banned
    bad_word_rows: list[int]  # rows with a bad word of several tokens (matched against their history)
    uses_min_p: bool
    uses_top_k_or_p: bool
    # (rows, 7) float32 on the device, columns as _IS_GREEDY ... above; None when every row is greedy and unpenalised
    values: torch.Tensor | None
    top_ks: torch.Tensor | None  # (rows,) int64 on the device, the vocabulary size where a row keeps all; or None

    @classmethod
    def build(
        cls, params: list[SamplingParams], num_generated: list[int], req_keys: list[int], vocab_size: int,
        device: torch.device,
    ) -> SamplingBatch:  # fmt: skip
        greedy = [is_greedy(p) for p in params]
        penalty_rows = [i for i, p in enumerate(params) if p.uses_penalty]
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        uses_top_k_or_p = any(k != vocab_size for k in top_ks) or any(p.top_p < 1.0 for p in params)
        banned = [
            (i, t)
            for i, (p, step) in enumerate(zip(params, num_generated, strict=True))
            if step < p.min_new_tokens
            for t in p.stop_token_ids
            if t < vocab_size
        ]
        banned += [(i, word[0]) for i, p in enumerate(params) for word in p.bad_words_ids if len(word) == 1]
        bias = [(i, t, v) for i, p in enumerate(params) for t, v in p.logit_bias.items()]
        allowed = [(i, t) for i, p in enumerate(params) if p.allowed_token_ids is not None for t in p.allowed_token_ids]
        values = None
        if not all(greedy) or penalty_rows:
            # greedy rows are scaled by 1 only to stay finite; their token is the argmax anyway
            rows = [
                [float(g), 1.0 if g else p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty,
                 p.presence_penalty]  # fmt: skip
                for p, g in zip(params, greedy, strict=True)
            ]
            values = torch.tensor(rows, dtype=torch.float32).to(device)  # (rows, 7)
        return cls(
            params=params,
            num_generated=num_generated,
            req_keys=req_keys,
            is_greedy=greedy,
            penalty_rows=penalty_rows,
            history_rows=[i for i, p in enumerate(params) if p.needs_token_history],
            constrained_rows=[i for i, p in enumerate(params) if p.constraint is not None],
            logprob_rows=[i for i, p in enumerate(params) if p.logprobs >= 0],
            banned=([i for i, _ in banned], [t for _, t in banned]),
            bias=([i for i, _, _ in bias], [t for _, t, _ in bias], [v for _, _, v in bias]),
            allowed=([i for i, _ in allowed], [t for _, t in allowed]),
            bad_word_rows=[i for i, p in enumerate(params) if any(len(w) > 1 for w in p.bad_words_ids)],
            uses_min_p=any(p.min_p > 0.0 for p in params),
            uses_top_k_or_p=uses_top_k_or_p,
            values=values,
            top_ks=torch.tensor(top_ks).to(device) if uses_top_k_or_p and not all(greedy) else None,
        )

    @classmethod
    def of(cls, reqs: list[ForwardReq], params: list[SamplingParams], vocab_size: int,
           device: torch.device) -> SamplingBatch:  # fmt: skip
        """The batch of a pass's requests, given each one's parameters (SamplingTable.resolve)."""
        return cls.build(params, [r.num_generated for r in reqs], [r.req_key for r in reqs], vocab_size, device)

    @property
    def is_all_greedy(self) -> bool:
        return all(self.is_greedy)

    def column(self, index: int, rows: torch.Tensor | None = None, width: int = 1) -> torch.Tensor:
        """(rows, width) values of `width` columns from `index`, for every row or the ones indexed."""
        assert self.values is not None, "every row is greedy and unpenalised: no column was built"
        values = self.values if rows is None else self.values[rows]
        return values[:, index : index + width]

    @property
    def greedy_mask(self) -> torch.Tensor:
        return self.column(_IS_GREEDY)[:, 0] > 0  # (rows,)

    @property
    def temperatures(self) -> torch.Tensor:
        return self.column(_TEMPERATURE)  # (rows, 1)

    @property
    def top_ps(self) -> torch.Tensor:
        return self.column(_TOP_P)  # (rows, 1)

    @property
    def min_ps(self) -> torch.Tensor:
        return self.column(_MIN_P)  # (rows, 1)

    def penalties(self, rows: torch.Tensor | None) -> torch.Tensor:
        """(rows, 3) repetition, frequency and presence penalties, for every row or the ones indexed."""
        return self.column(_REPETITION, rows, width=3)
