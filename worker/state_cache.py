"""A hybrid model's second cache beside the paged KV: one fixed-size state slot per running request, holding each
linear-attention layer's recurrent state and conv state for this rank's heads and channels.

The scheduler hands out the slots (scheduler/state_slots.py) and names each request's in ForwardReq.state_slot; the
layers read and write the states in place. A pass from position 0 (a new request, or a preempted one recomputed)
starts its slot from zero.

Beside the slots, a pool of snapshots of the same shape serves the prefix cache: the states of one request at one
cached page boundary, which the scheduler owns and names. A pass that starts at a prefix-cache hit copies the hit's
snapshot into its slot (ForwardReq.restore_snapshot) before any layer runs; a pass that crosses a boundary the
scheduler wants kept (ForwardReq.snapshot_saves) is cut there: each layer runs the tokens before the boundary, copies
the slot's states into the snapshot, then runs the rest. The conv state at position p is then the last kernel - 1
inputs before p, and the recurrent state the one after the tokens before p, as a pass ending at p leaves them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from loraplex.protocol.structs import ForwardReq
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.kv_cache import KVCache


class StateSlotError(BatchError):
    """A request of a hybrid model's batch names no state slot, or one outside the cache."""


@dataclass(frozen=True)
class StateBatch:
    """Where each request's tokens and state sit in this pass: host lists for the torch path, which loops over the
    prefills; the same on the device as one table for the Triton kernels, which take the whole batch per launch."""

    slots: list[int]  # per request
    token_starts: list[int]  # its first row in the flat batch
    num_new: list[int]  # its rows
    decode_rows: torch.Tensor  # (decodes,) the rows of the one-token requests, batched in one recurrent step
    decode_slots: torch.Tensor  # (decodes,) their slots
    prefills: list[int]  # the requests stepped one by one in chunked form (more than one new token, or stepwise)
    table: torch.Tensor  # (3, reqs) int32 [first rows; new tokens; slots]: the Triton kernels' whole batch

    @classmethod
    def of(cls, slots: list[int], num_new: list[int], device: torch.device, starts: list[int] | None = None,
           stepwise: bool = False) -> StateBatch:  # fmt: skip
        """Requests laid one after the other from row 0, or from `starts`; `stepwise`: none of them batched as a
        one-token decode (a round's pieces, whose rows are not its requests)."""
        if starts is None:
            starts = [0] * len(slots)
            for i in range(1, len(slots)):
                starts[i] = starts[i - 1] + num_new[i - 1]
        decodes = [] if stepwise else [i for i, n in enumerate(num_new) if n == 1]
        return cls(
            slots=slots,
            token_starts=starts,
            num_new=num_new,
            decode_rows=torch.tensor([starts[i] for i in decodes], dtype=torch.long, device=device),
            decode_slots=torch.tensor([slots[i] for i in decodes], dtype=torch.long, device=device),
            prefills=[i for i in range(len(slots)) if i not in decodes],
            table=torch.tensor([starts, num_new, slots], dtype=torch.int32, device=device).view(3, len(slots)),
        )


@dataclass(frozen=True)
class StateRound:
    """What a layer runs in one go: a pass without saves is one round over its whole batch; a pass with saves runs
    each request's pieces (its rows cut after each save) in rounds, the r-th piece of every request in round r, and
    copies the states of `saves` into their snapshots once the round has run."""

    batch: StateBatch
    rows: torch.Tensor | None  # (rows,) the rows its pieces cover; None: every row of the pass
    saves: tuple[tuple[int, int], ...]  # (slot, snapshot)


def run_rounds(rounds: tuple[StateRound, ...], run: Callable[[StateBatch], torch.Tensor], states: torch.Tensor,
               snapshots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """run(batch) -> an output over every row of the pass, those of the batch's pieces written; each round's saves
    copy states[slot] into snapshots[snapshot]. The rounds' rows, taken together, are every row once."""
    out = None
    for state_round in rounds:
        part = run(state_round.batch)
        if out is None:
            out = part
        else:
            out[state_round.rows] = part[state_round.rows]
        for slot, snapshot in state_round.saves:
            snapshots[snapshot] = states[slot]
    assert out is not None
    return out


@dataclass(frozen=True)
class LayerState:
    conv: torch.Tensor  # (slots, conv_channels, kernel - 1): the last inputs of the causal conv
    recurrent: torch.Tensor  # (slots, value_heads, key_head_dim, value_head_dim)
    conv_snapshots: torch.Tensor  # (snapshots, conv_channels, kernel - 1)
    recurrent_snapshots: torch.Tensor  # (snapshots, value_heads, key_head_dim, value_head_dim)
    rounds: tuple[StateRound, ...]  # this pass's, in order (one when it saves no snapshot)


@dataclass(frozen=True)
class StateShape:
    """One state slot (or snapshot) on this rank: every linear-attention layer's conv state and recurrent state, this
    rank's channels and heads. Its bytes come out of the memory the KV cache is sized from (worker/kv_cache.py)."""

    num_linear_layers: int
    conv_channels: int
    conv_state_len: int  # kernel - 1
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    dtype: torch.dtype

    @property
    def slot_bytes(self) -> int:
        per_layer = self.conv_channels * self.conv_state_len + self.num_value_heads * self.key_head_dim * \
            self.value_head_dim  # fmt: skip
        return self.num_linear_layers * per_layer * self.dtype.itemsize


@dataclass(frozen=True)
class StatePlan:
    """What a hybrid model's HybridCache will hold, known before it is built (the KV budget leaves its bytes out)."""

    num_slots: int  # one per running request
    num_snapshots: int  # the prefix cache's
    shape: StateShape


class HybridCache(KVCache):
    """The KV cache of the attention layers (KVCache's `layer(i)` takes the i-th attention layer) and the state
    slots of the linear-attention ones (`linear_state(i)`, the i-th such layer, for the batch `begin` set)."""

    def __init__(self, *, num_state_slots: int, num_state_snapshots: int, state_shape: StateShape, **kv_args):
        super().__init__(**kv_args)
        device, state_dtype, shape = kv_args["device"], state_shape.dtype, state_shape
        self.num_state_slots = num_state_slots
        self.num_state_snapshots = num_state_snapshots
        conv_shape = (shape.num_linear_layers, shape.conv_channels, shape.conv_state_len)
        recurrent_shape = (shape.num_linear_layers, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim)
        # (layers, slots or snapshots, ...): a slot's or snapshot's states of every layer are one index
        self.conv = torch.zeros(_with_count(conv_shape, num_state_slots), dtype=state_dtype, device=device)
        self.recurrent = torch.zeros(_with_count(recurrent_shape, num_state_slots), dtype=state_dtype, device=device)
        self.conv_snapshots = torch.zeros(_with_count(conv_shape, num_state_snapshots), dtype=state_dtype,
                                          device=device)  # fmt: skip
        self.recurrent_snapshots = torch.zeros(_with_count(recurrent_shape, num_state_snapshots), dtype=state_dtype,
                                               device=device)  # fmt: skip
        self._rounds: tuple[StateRound, ...] = ()

    @property
    def state_bytes(self) -> int:
        """Of the slots (the snapshots: snapshot_bytes)."""
        return self.conv.nbytes + self.recurrent.nbytes

    @property
    def snapshot_bytes(self) -> int:
        return self.conv_snapshots.nbytes + self.recurrent_snapshots.nbytes

    def begin(self, reqs: list[ForwardReq]) -> None:
        """Bind the states to this pass's requests; zero the slots of those starting at position 0, and copy each
        restored snapshot into its request's slot."""
        self._check(reqs)
        slots = [req.state_slot for req in reqs]
        fresh = [req.state_slot for req in reqs if req.num_cached_tokens == 0]
        if fresh:
            index = torch.tensor(fresh, device=self.conv.device)
            self.conv[:, index] = 0
            self.recurrent[:, index] = 0
        restored = [req for req in reqs if req.restore_snapshot >= 0]
        if restored:
            into = torch.tensor([req.state_slot for req in restored], device=self.conv.device)
            source = torch.tensor([req.restore_snapshot for req in restored], device=self.conv.device)
            self.conv[:, into] = self.conv_snapshots[:, source]
            self.recurrent[:, into] = self.recurrent_snapshots[:, source]
        num_new = [len(req.input_ids) for req in reqs]
        if not any(req.snapshot_saves for req in reqs):
            self._rounds = (StateRound(StateBatch.of(slots, num_new, self.conv.device), rows=None, saves=()),)
        else:
            self._rounds = _rounds(reqs, self.conv.device)

    def _check(self, reqs: list[ForwardReq]) -> None:
        bad = [req.state_slot for req in reqs if not 0 <= req.state_slot < self.num_state_slots]
        if bad:
            raise StateSlotError(f"state slots {bad[:4]} outside 0..{self.num_state_slots - 1}")
        slots = [req.state_slot for req in reqs]
        if len(set(slots)) != len(slots):
            raise StateSlotError(f"a state slot is named twice in one batch: {slots}")
        named = [s for req in reqs for s in [req.restore_snapshot] if s != -1]
        named += [s for req in reqs for _, s in req.snapshot_saves]
        bad = [s for s in named if not 0 <= s < self.num_state_snapshots]
        if bad:
            raise StateSlotError(f"state snapshots {bad[:4]} outside 0..{self.num_state_snapshots - 1}")
        if len(set(named)) != len(named):
            raise StateSlotError(f"a state snapshot is named twice in one batch: {named}")
        for req in reqs:
            if req.restore_snapshot != -1 and req.num_cached_tokens == 0:
                raise StateSlotError(f"state slot {req.state_slot} restores a snapshot at position 0")
            end = req.num_cached_tokens + len(req.input_ids)
            positions = [p for p, _ in req.snapshot_saves]
            if positions != sorted(set(positions)) or not all(req.num_cached_tokens < p <= end for p in positions):
                raise StateSlotError(f"state slot {req.state_slot} saves snapshots at {positions}, not increasing "
                                     f"positions in its pass's {req.num_cached_tokens + 1}..{end}")  # fmt: skip

    def linear_state(self, index: int) -> LayerState:
        if not self._rounds:
            raise RuntimeError("HybridCache.begin(reqs) must run before a hybrid model's forward pass")
        return LayerState(conv=self.conv[index], recurrent=self.recurrent[index],
                          conv_snapshots=self.conv_snapshots[index],
                          recurrent_snapshots=self.recurrent_snapshots[index], rounds=self._rounds)  # fmt: skip


def _with_count(shape: tuple[int, ...], count: int) -> tuple[int, ...]:
    """(layers, *rest) -> (layers, count, *rest)"""
    return (shape[0], count, *shape[1:])


def _pieces(req: ForwardReq, start: int) -> list[tuple[slice, int]]:
    """The request's rows from `start`, cut after each save position, each piece with its snapshot (-1: none)."""
    pieces, begin = [], start
    for position, snapshot in req.snapshot_saves:
        end = start + position - req.num_cached_tokens
        pieces.append((slice(begin, end), snapshot))
        begin = end
    if begin < start + len(req.input_ids):
        pieces.append((slice(begin, start + len(req.input_ids)), -1))
    return pieces


def _rounds(reqs: list[ForwardReq], device: torch.device) -> tuple[StateRound, ...]:
    """The pass in rounds: round r runs the r-th piece of every request that has one (a request saving nothing is
    one piece, in round 0), stepwise, and saves after each piece its snapshot."""
    pieces, start = [], 0
    for req in reqs:
        pieces.append(_pieces(req, start))
        start += len(req.input_ids)
    rounds = []
    for r in range(max(len(p) for p in pieces)):
        members = [(req.state_slot, p[r]) for req, p in zip(reqs, pieces, strict=True) if len(p) > r]
        rows = [s for _, (s, _) in members]
        batch = StateBatch.of([slot for slot, _ in members], [s.stop - s.start for s in rows], device,
                              starts=[s.start for s in rows], stepwise=True)  # fmt: skip
        index = torch.cat([torch.arange(s.start, s.stop, device=device) for s in rows])
        saves = tuple((slot, snapshot) for slot, (_, snapshot) in members if snapshot >= 0)
        rounds.append(StateRound(batch, rows=index, saves=saves))
    return tuple(rounds)
