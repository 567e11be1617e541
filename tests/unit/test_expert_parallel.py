"""Expert parallelism's arithmetic without processes: the dispatch and combine of worker/layers/expert_parallel.py,
run by two ranks in threads over an in-memory all-to-all, give each token the weighted sum of its experts' outputs;
an ExpertsLinear under expert parallelism holds its rank's experts whole, from stacked and per-expert tensors."""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from loraplex.protocol.config import ServerConfig
from loraplex.worker.layers.expert_parallel import ExpertDispatcher
from loraplex.worker.layers.moe import ExpertsLinear, Routing
from loraplex.worker.model.config import ModelConfigError
from loraplex.worker.model_runner import ModelRunner
from loraplex.worker.parallel import tensor_parallel

from tests.moe_models import hf_config

HIDDEN, NUM_EXPERTS, TOP_K = 8, 4, 2


class ThreadExchange:
    """all_to_all among `world_size` threads: each leaves its pieces for the others, then takes its own."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.boxes: list[list[torch.Tensor]] = [[] for _ in range(world_size)]

    def for_rank(self, rank: int):
        def exchange(x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
            assert x.shape[0] == sum(send_counts)
            self.boxes[rank] = list(x.split(send_counts))
            self.barrier.wait()
            pieces = [self.boxes[source][rank] for source in range(self.world_size)]
            self.barrier.wait()  # nobody leaves the next exchange's pieces before all took this one's
            assert [p.shape[0] for p in pieces] == recv_counts
            return torch.cat(pieces)

        return exchange


def ep_routed(hidden, weights, ids, expert_weights, world_size: int) -> tuple[torch.Tensor, list[Routing]]:
    """Each rank's dispatch, its experts (expert e: rows · W_eᵀ) on what it receives, combine; the ranks' outputs
    placed in the batch and summed (the block's all-reduce), and each rank's Routing of its received rows."""
    exchange = ThreadExchange(world_size)

    def rank_run(rank: int) -> tuple[torch.Tensor, Routing]:
        dispatcher = ExpertDispatcher(NUM_EXPERTS, rank, world_size, exchange.for_rank(rank))
        start, end = dispatcher.token_range(hidden.shape[0])
        got = dispatcher.dispatch(hidden[start:end], weights[start:end], ids[start:end], start)
        routing, order = Routing.of_rows(got.expert_ids, got.token_ids, got.row_weights, dispatcher.num_local_experts)
        rows = got.rows[order]
        routed = torch.empty_like(rows)
        for local in range(dispatcher.num_local_experts):
            lo, hi = routing.expert_bounds[local], routing.expert_bounds[local + 1]
            routed[lo:hi] = rows[lo:hi] @ expert_weights[dispatcher.first_expert + local].T
        out_rows = torch.empty_like(rows)
        out_rows[order] = routed * routing.row_weights[:, None]
        out = torch.zeros_like(hidden)
        out[start:end] = dispatcher.combine(out_rows, got, end - start)
        return out, routing

    with ThreadPoolExecutor(world_size) as pool:
        results = list(pool.map(rank_run, range(world_size)))
    return sum(out for out, _ in results), [routing for _, routing in results]


@pytest.mark.parametrize("num_tokens", [1, 5, 12])
def test_dispatch_combine_gives_each_token_its_experts_sum(num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    expert_weights = torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, TOP_K, generator=gen)
    expected = torch.zeros_like(hidden)
    for t in range(num_tokens):
        for j in range(TOP_K):
            expected[t] += weights[t, j] * (expert_weights[ids[t, j]] @ hidden[t])
    out, routings = ep_routed(hidden, weights, ids, expert_weights, world_size=2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for rank, routing in enumerate(routings):
        # rank r's rows: the batch's picks of its experts, by expert, tokens in batch order within one (LoRA's runs)
        for local in range(2):
            tokens = routing.host_token_ids[routing.expert_bounds[local] : routing.expert_bounds[local + 1]]
            assert tokens == [t for t in range(num_tokens) if 2 * rank + local in ids[t].tolist()]


def test_token_ranges_cover_the_batch_in_order() -> None:
    for num_tokens in (0, 1, 2, 7):
        ranges = [ExpertDispatcher(6, rank, 3).token_range(num_tokens) for rank in range(3)]
        assert ranges[0][0] == 0 and ranges[-1][1] == num_tokens
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1


def test_experts_not_divisible_by_tp_are_refused() -> None:
    with pytest.raises(ValueError, match="divisible by tp 3"):
        ExpertDispatcher(4, 0, 3)
    with tensor_parallel(0, 3, expert_parallel=True), pytest.raises(ValueError, match="divisible by tp 3"):
        ExpertsLinear(4, HIDDEN, [6, 6], "column")


@pytest.mark.parametrize("tp_mode", ["column", "row"])
def test_experts_linear_holds_its_experts_whole(tp_mode: str) -> None:
    """Stacked tensor (one call) and per-expert pieces (every expert offered; another rank's skipped) load alike."""
    sizes = [6, 6] if tp_mode == "column" else [HIDDEN]
    full = torch.randn(NUM_EXPERTS, sum(sizes), HIDDEN)
    for rank in range(2):
        with tensor_parallel(rank, 2, expert_parallel=True):
            stacked = ExpertsLinear(NUM_EXPERTS, HIDDEN, sizes, tp_mode, bias=True)
            pieces = ExpertsLinear(NUM_EXPERTS, HIDDEN, sizes, tp_mode)
        assert stacked.full_shape(stacked.weight) == tuple(full.shape)
        stacked.weight_loader(stacked.weight, full, None)
        bias = torch.randn(NUM_EXPERTS, sum(sizes))
        stacked.bias_loader(stacked.bias, bias, None)
        starts = [0, sizes[0]]
        for expert in range(NUM_EXPERTS):
            for slice_id, size in enumerate(sizes):
                pieces.weight_loader(pieces.weight, full[expert, starts[slice_id] : starts[slice_id] + size],
                                     (expert, slice_id))  # fmt: skip
        mine = slice(2 * rank, 2 * rank + 2)
        assert stacked.num_experts == 2 and stacked.first_expert == 2 * rank
        assert stacked.checkpoint_shards()[0] == (2 * rank, 0)
        torch.testing.assert_close(stacked.weight.data, full[mine], rtol=0, atol=0)
        torch.testing.assert_close(pieces.weight.data, full[mine], rtol=0, atol=0)
        torch.testing.assert_close(stacked.bias.data, bias[mine], rtol=0, atol=0)


def test_a_model_whose_experts_tp_does_not_divide_is_refused_at_start(tmp_path: Path) -> None:
    """Before any weight is read: config.json alone."""
    hf_config("qwen3_moe", num_experts=3).save_pretrained(tmp_path)
    config = ServerConfig(device="cpu", tp=2, enable_expert_parallel=True)
    with pytest.raises(ModelConfigError, match=r"--enable-expert-parallel: tp 2 must divide the experts \(3\)"):
        ModelRunner(config, str(tmp_path), 0, 2, "cpu")
