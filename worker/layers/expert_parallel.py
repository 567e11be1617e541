"""Expert parallelism (--enable-expert-parallel): an MoE layer's routed experts sharded by expert over the
tensor-parallel group, rank r holding experts r * E / tp ... (r + 1) * E / tp - 1 whole (worker/layers/moe.py's
ExpertsLinear), and the dispatch and combine that bring each (token, chosen expert) row to the rank holding its
expert and its output back.

Every rank holds the whole batch's hidden states (attention stays tensor-parallel, its output all-reduced). Rank r
routes its own share of the tokens (`token_range`: contiguous, the first ranks one more when they do not divide),
sends each of their rows to its expert's owner (one all-to-all of the rows' hidden states, one of their batch token
ids, experts and routing weights), runs its experts on the rows it receives, and sends each output back to the rank
the row came from (a second all-to-all), which sums its tokens' outputs. The block places those sums in its
(tokens, hidden) output, zero elsewhere, and its one all-reduce gives every rank the whole output, as under TP.

Each rank sends its rows sorted by expert, tokens in batch order within one, and receives them in sender order:
sorted by expert (stably), the rows of one expert keep batch order, and the LoRA wrappers find their (expert, slot)
runs there as under TP."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from loraplex.worker.parallel import all_to_all

# all_to_all's signature: (rows, send_counts, recv_counts) -> the rows received
Exchange = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


@dataclass
class Dispatched:
    """The rows one rank received: what its experts compute on, and how their outputs go back."""

    rows: torch.Tensor  # (received, hidden)
    expert_ids: torch.Tensor  # (received,) int64: the local expert of each row (0 ... experts per rank - 1)
    token_ids: torch.Tensor  # (received,) int64: each row's token in the whole batch
    row_weights: torch.Tensor  # (received,) float32: each row's routing weight
    sent_token_ids: torch.Tensor  # (sent,) int64: the token (within this rank's share) of each row sent, in send order
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank


class ExpertDispatcher:
    """One MoE layer's dispatch and combine over the group; `exchange` is the group's all-to-all."""

    def __init__(self, num_experts: int, rank: int, world_size: int, exchange: Exchange = all_to_all):
        if num_experts % world_size:
            raise ValueError(f"expert parallelism needs the experts ({num_experts}) divisible by tp {world_size}")
        self.rank, self.world_size, self.exchange = rank, world_size, exchange
        self.num_local_experts = num_experts // world_size
        self.first_expert = rank * self.num_local_experts

    def token_range(self, num_tokens: int) -> tuple[int, int]:
        """[start, end) of the batch's tokens this rank routes and sends."""
        per_rank, extra = divmod(num_tokens, self.world_size)
        start = self.rank * per_rank + min(self.rank, extra)
        return start, start + per_rank + (self.rank < extra)

    def dispatch(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, token_start: int
    ) -> Dispatched:
        """hidden (tokens, hidden): this rank's tokens, the batch's from token_start on; topk_* (tokens, top_k):
        their routing. Sends every (token, choice) row to its expert's owner; returns the rows this rank received."""
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.flatten()  # (tokens * top_k,) row t * top_k + j: token t's j-th choice
        # by expert, tokens in order within one (so by owner too): combine then adds each token's outputs in the
        # order a single rank's block adds them
        order = torch.sort(flat_ids, stable=True).indices
        sent_token_ids = order // top_k
        send_counts = torch.bincount(flat_ids // self.num_local_experts, minlength=self.world_size)  # (world,)
        recv_counts = self.exchange(send_counts, [1] * self.world_size, [1] * self.world_size)
        counts = torch.cat([send_counts, recv_counts]).tolist()  # one copy to the host: the exchanges' sizes
        send, recv = counts[: self.world_size], counts[self.world_size :]
        # token ids and experts are exact in float64, as are float32 weights: one exchange carries all three
        meta = torch.stack([(sent_token_ids + token_start).double(), flat_ids[order].double(),
                            topk_weights.flatten()[order].double()], dim=1)  # fmt: skip  # (sent, 3)
        rows = self.exchange(hidden[sent_token_ids], send, recv)  # (received, hidden)
        recv_meta = self.exchange(meta, send, recv)  # (received, 3)
        return Dispatched(
            rows=rows,
            expert_ids=recv_meta[:, 1].long() - self.first_expert,
            token_ids=recv_meta[:, 0].long(),
            row_weights=recv_meta[:, 2].float(),
            sent_token_ids=sent_token_ids,
            send_counts=send,
            recv_counts=recv,
        )

    def combine(self, out_rows: torch.Tensor, dispatched: Dispatched, num_tokens: int) -> torch.Tensor:
        """out_rows (received, hidden): each received row's weighted output, in received order. Sends each back to
        its sender; returns (num_tokens, hidden): the sum over each of this rank's tokens of its rows' outputs."""
        returned = self.exchange(out_rows, dispatched.recv_counts, dispatched.send_counts)  # (sent, hidden)
        out = out_rows.new_zeros(num_tokens, out_rows.shape[1])
        return out.index_add_(0, dispatched.sent_token_ids, returned)
