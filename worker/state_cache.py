"""A hybrid model's second cache beside the paged KV: one fixed-size state slot per running request, holding each
linear-attention layer's recurrent state and conv state for this rank's heads and channels.

The scheduler hands out the slots (scheduler/state_slots.py) and names each request's in ForwardReq.state_slot; the
layers read and write the states in place. A pass from position 0 (a new request, or a preempted one recomputed)
starts its slot from zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from loraplex.protocol.structs import ForwardReq
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.kv_cache import KVCache


class StateSlotError(BatchError):
    """A request of a hybrid model's batch names no state slot, or one outside the cache."""


@dataclass(frozen=True)
class StateBatch:
    """Where each request's tokens and state sit in this pass (host lists: the layers loop over prefills)."""

    slots: list[int]  # per request
    token_starts: list[int]  # its first row in the flat batch
    num_new: list[int]  # its rows
    decode_rows: torch.Tensor  # (decodes,) the rows of the one-token requests, batched in one recurrent step
    decode_slots: torch.Tensor  # (decodes,) their slots
    prefills: list[int]  # the requests with more than one new token, stepped one by one in chunked form


@dataclass(frozen=True)
class LayerState:
    conv: torch.Tensor  # (slots, conv_channels, kernel - 1): the last inputs of the causal conv
    recurrent: torch.Tensor  # (slots, value_heads, key_head_dim, value_head_dim)
    batch: StateBatch


@dataclass(frozen=True)
class StateShape:
    """One state slot on this rank: every linear-attention layer's conv state and recurrent state, this rank's
    channels and heads. Its bytes come out of the memory the KV cache is sized from (worker/kv_cache.py)."""

    num_linear_layers: int
    conv_channels: int
    conv_state_len: int  # kernel - 1
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    dtype: torch.dtype

    @property
    def conv_shape(self) -> tuple[int, int]:
        return self.conv_channels, self.conv_state_len

    @property
    def recurrent_shape(self) -> tuple[int, int, int]:
        return self.num_value_heads, self.key_head_dim, self.value_head_dim

    @property
    def slot_bytes(self) -> int:
        per_layer = self.conv_channels * self.conv_state_len + self.num_value_heads * self.key_head_dim * \
            self.value_head_dim  # fmt: skip
        return self.num_linear_layers * per_layer * self.dtype.itemsize


class HybridCache(KVCache):
    """The KV cache of the attention layers (KVCache's `layer(i)` takes the i-th attention layer) and the state
    slots of the linear-attention ones (`linear_state(i)`, the i-th such layer, for the batch `begin` set)."""

    def __init__(self, *, num_state_slots: int, state_shape: StateShape, **kv_args):
        super().__init__(**kv_args)
        device, layers = kv_args["device"], state_shape.num_linear_layers
        self.num_state_slots = num_state_slots
        self.conv = torch.zeros(layers, num_state_slots, *state_shape.conv_shape, dtype=state_shape.dtype,
                                device=device)  # fmt: skip
        self.recurrent = torch.zeros(layers, num_state_slots, *state_shape.recurrent_shape, dtype=state_shape.dtype,
                                     device=device)  # fmt: skip
        self._batch: StateBatch | None = None

    @property
    def state_bytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def begin(self, reqs: list[ForwardReq]) -> None:
        """Bind the states to this pass's requests; zero the slots of those starting at position 0."""
        bad = [req.state_slot for req in reqs if not 0 <= req.state_slot < self.num_state_slots]
        if bad:
            raise StateSlotError(f"state slots {bad[:4]} outside 0..{self.num_state_slots - 1}")
        slots = [req.state_slot for req in reqs]
        if len(set(slots)) != len(slots):
            raise StateSlotError(f"a state slot is named twice in one batch: {slots}")
        fresh = [req.state_slot for req in reqs if req.num_cached_tokens == 0]
        if fresh:
            index = torch.tensor(fresh, device=self.conv.device)
            self.conv[:, index] = 0
            self.recurrent[:, index] = 0
        num_new = [len(req.input_ids) for req in reqs]
        starts = [0] * len(reqs)
        for i in range(1, len(reqs)):
            starts[i] = starts[i - 1] + num_new[i - 1]
        decodes = [i for i, n in enumerate(num_new) if n == 1]
        device = self.conv.device
        self._batch = StateBatch(
            slots=slots,
            token_starts=starts,
            num_new=num_new,
            decode_rows=torch.tensor([starts[i] for i in decodes], dtype=torch.long, device=device),
            decode_slots=torch.tensor([slots[i] for i in decodes], dtype=torch.long, device=device),
            prefills=[i for i, n in enumerate(num_new) if n > 1],
        )

    def linear_state(self, index: int) -> LayerState:
        if self._batch is None:
            raise RuntimeError("HybridCache.begin(reqs) must run before a hybrid model's forward pass")
        return LayerState(conv=self.conv[index], recurrent=self.recurrent[index], batch=self._batch)
