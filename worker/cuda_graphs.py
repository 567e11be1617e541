"""DecodeGraphRunner: decode steps replayed from CUDA graphs captured at start-up, one per batch size of a ladder.

A graph replays fixed device addresses and fixed shapes, so every input of a decode step lives in a static buffer:
token ids, positions, cache slots, the page table (as wide as the context length), key counts, and the LoRA segment
metadata (padded with empty segments to the graph's batch size, every LoRA linear active). A batch of B decodes runs
in the graph of the smallest size n >= B: its rows are copied into the buffers, rows B..n are padding (token 0 at
position 0 of the KV cache's scratch page, which no request owns, no adapter), and the graph replays; the first B
rows of the static logits are the batch's. The attention is the paged Triton decode with a split count fixed by the
graph's size and the context length (kernels/paged_attention.py: decode_num_splits), so any lengths replay. MoE layers
route inside the graph with device ops alone (worker/layers/moe.py: Routing.build(on_device=True)), so their rows,
expert offsets and expert LoRA segments are recomputed at each replay from the step's own router logits.

Without capture (a CPU: tests) `logits` runs the same forward eagerly on the same buffers, so everything but the
capture itself is checked without a GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from loraplex.kernels import LoRABatchMeta
from loraplex.kernels.paged_attention import decode_num_splits
from loraplex.protocol.mathutil import cdiv
from loraplex.protocol.structs import ForwardReq, SamplingParams
from loraplex.worker.batch_inputs import BatchError, check_reqs, rotary_row
from loraplex.worker.kv_cache import KVCache
from loraplex.worker.layers.triton_attention import DecodeMeta, PagedAttentionInputs
from loraplex.worker.lora.manager import LoRAManager

logger = logging.getLogger(__name__)

_PAD_REQ = ForwardReq(input_ids=[0], num_cached_tokens=0, page_ids=[], sampling=SamplingParams(), slot=-1)


@dataclass
class _Entry:
    """One batch size: its attention metadata (views of the buffers), LoRA metadata and graph."""

    size: int
    attention: PagedAttentionInputs
    lora_meta: LoRABatchMeta | None
    graph: torch.cuda.CUDAGraph | None
    logits: torch.Tensor | None  # (size, vocab), the graph's output


class DecodeGraphRunner:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, PagedAttentionInputs], torch.Tensor],
        kv_cache: KVCache,
        lora: LoRAManager | None,
        *,
        batch_sizes: Sequence[int],
        num_kv_heads: int,
        context_length: int,
        device: torch.device,
        capture: bool,
    ):
        """`forward(input_ids, positions, attention) -> logits` is the model's decode step (ModelRunner's)."""
        self.forward = forward
        self.kv_cache, self.lora = kv_cache, lora
        self.page_size = kv_cache.page_size
        self.context_length = context_length
        self.sizes = sorted(batch_sizes)
        largest = self.sizes[-1]
        max_pages = cdiv(context_length, self.page_size)
        self.input_ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.write_slots = torch.zeros(largest, dtype=torch.long, device=device)
        self.page_table = torch.zeros(largest, max_pages, dtype=torch.int32, device=device)
        self.kv_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.q_rows = torch.arange(largest, dtype=torch.int32, device=device)
        self.device = device
        self.entries: dict[int, _Entry] = {}
        pool = None
        start = time.perf_counter()
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            decode = DecodeMeta(
                self.page_table[:size],
                self.kv_lens[:size],
                self.q_rows[:size],
                decode_num_splits(size, num_kv_heads, context_length),
            )
            entry = _Entry(size, PagedAttentionInputs(self.write_slots[:size], self.page_size, decode, None), None,
                           None, None)  # fmt: skip
            self._fill([], entry)  # every row padding: valid inputs for the capture's runs
            if capture:
                entry.graph, entry.logits, pool = self._capture(entry, pool)
            self.entries[size] = entry
        if capture:
            logger.info("CUDA graphs captured for decode batches of %s in %.1f s", ",".join(map(str, self.sizes)),
                        time.perf_counter() - start)  # fmt: skip

    def can_run(self, reqs: Sequence[ForwardReq]) -> bool:
        # a batch with request strengths (lora_scale) other than 1 runs eagerly: the graphs hold no row scales
        # and a pass with images or M-RoPE rows (a prompt's last token) too: the graphs take one position a token
        return len(reqs) <= self.sizes[-1] and all(len(req.input_ids) == 1 and req.lora_scale == 1.0
                                                   and not req.images and not req.mrope_positions for req in reqs)

    def logits(self, reqs: list[ForwardReq]) -> torch.Tensor:
        """(reqs, vocab) logits of a batch of decodes; a view of the graph's output, valid until the next call."""
        check_reqs(reqs, self.page_size, self.kv_cache.num_pages, self.context_length)
        entry = self.entries[next(size for size in self.sizes if size >= len(reqs))]
        self._fill(reqs, entry)
        if entry.graph is None:
            return self._run(entry)[: len(reqs)]
        with torch.cuda.device(self.device):
            entry.graph.replay()
        return entry.logits[: len(reqs)]

    def _run(self, entry: _Entry) -> torch.Tensor:
        size = entry.size
        return self.forward(self.input_ids[:size], self.positions[:size], entry.attention)  # (size, vocab)

    def _fill(self, reqs: list[ForwardReq], entry: _Entry) -> None:
        """The batch's rows, then padding rows, into the buffers (one host-to-device copy), and the LoRA metadata."""
        size, page_size, scratch = entry.size, self.page_size, self.kv_cache.scratch_page
        used_pages = [req.page_ids[: req.num_cached_tokens // page_size + 1] for req in reqs]
        width = max((len(pages) for pages in used_pages), default=1)
        num_pads = size - len(reqs)
        positions = [req.num_cached_tokens for req in reqs] + [0] * num_pads
        input_ids = [req.input_ids[0] for req in reqs] + [0] * num_pads
        # the new token's slot: on the last used page (zip stops at the real rows; positions has the padding too)
        write_slots = [
            pages[-1] * page_size + pos % page_size for pages, pos in zip(used_pages, positions, strict=False)
        ]
        write_slots += [scratch * page_size] * num_pads
        table = [pages + [scratch] * (width - len(pages)) for pages in used_pages] + [[scratch] * width] * num_pads
        rows = [rotary_row(req, req.num_cached_tokens, self.context_length) for req in reqs] + [0] * num_pads
        staged = torch.tensor([input_ids, rows, write_slots, [p + 1 for p in positions]], dtype=torch.long)
        flat = torch.cat([staged.view(-1), torch.tensor(table, dtype=torch.long).view(-1)]).to(self.device)
        self.input_ids[:size].copy_(flat[:size])
        self.positions[:size].copy_(flat[size : 2 * size])
        self.write_slots[:size].copy_(flat[2 * size : 3 * size])
        self.kv_lens[:size].copy_(flat[3 * size : 4 * size])
        self.page_table[:size, :width].copy_(flat[4 * size :].view(size, width))
        if self.lora is not None:
            padded = [*reqs, *[_PAD_REQ] * num_pads]
            entry.lora_meta = self.lora.prepare_fixed(padded, size, entry.lora_meta)
        elif any(req.slot != -1 for req in reqs):
            raise BatchError("the batch uses adapter slots but LoRA is not enabled")

    def _capture(self, entry: _Entry, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, object]:
        # Everything on the runner's device, whatever the current one is: torch.cuda.graph's default capture stream
        # is created on the current device at first use, and Triton launches on the current device.
        with torch.cuda.device(self.device):
            # Eager runs first, on a side stream as torch asks: cuBLAS workspaces, NCCL communicators (under TP the
            # all-reduces run inside the graph, on every rank alike) and any first-use work happen there.
            stream = capture_stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._run(entry)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                logits = self._run(entry)
        return graph, logits, graph.pool()


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream on `device` (not the current device) for the warm-up runs and the capture."""
    return torch.cuda.Stream(device=device)
