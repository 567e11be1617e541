"""What differs between one model's attention layers, as every attention backend reads it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerAttention:
    scale: float  # of q·k before the softmax
    sliding_window: int | None = None  # a query at position p sees the keys at (p - window, p]; None = all up to p
    logit_cap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask and softmax (Gemma 2)
    # (heads of this rank,) a learned logit per head that joins the softmax's denominator and attends to no value
    # (gpt-oss): probs = exp(s_j) / (sum_k exp(s_k) + exp(sink)). The layer's parameter itself, so loading fills it.
    sinks: torch.Tensor | None = None
    # chunked local attention (Llama 4): a query at position p sees the keys at [p - p % chunk, p]; None = no chunks
    chunk_size: int | None = None
    # (2,) float32 keys' and values' scales of an FP8 KV cache (stored = value / scale), set by paged_attention from
    # the cache; None: the cache holds the values themselves
    kv_scales: torch.Tensor | None = None
    # False: a bidirectional encoder's (BERT) layer, where each token attends to every token of its sequence; the
    # sequence then comes whole in one pass (nothing cached before it), which the torch backends mask for
    is_causal: bool = True

    @classmethod
    def default(cls, head_dim: int) -> LayerAttention:
        return cls(scale=head_dim**-0.5)
