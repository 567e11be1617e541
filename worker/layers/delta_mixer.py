"""A Gated DeltaNet layer's token mixing over a whole batch: the causal conv + silu, then the gated delta rule, each
request reading and writing its state slots. Chosen once, when the layer is built, from the worker's model ops: the
Triton kernels where the ops are Triton's (CUDA; kernels/gated_delta.py, one launch per op for the batch), else torch
ops (layers/gated_delta.py: one call per prefilling request and one for all the decodes). The layer never asks which."""

from __future__ import annotations

import torch
from loraplex.kernels.gated_delta import (
    causal_conv_decode_triton,
    causal_conv_triton,
    delta_rule_decode_triton,
    delta_rule_triton,
)
from loraplex.worker.layers.gated_delta import chunked_rule, conv_decode, conv_prefill, l2norm, recurrent_step
from loraplex.worker.layers.ops import ModelOps
from loraplex.worker.state_cache import StateBatch


class TorchDeltaMixer:
    name = "torch"

    def conv(self, mixed: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
             batch: StateBatch) -> torch.Tensor:  # fmt: skip
        """silu(causal conv) (tokens, channels) of mixed (tokens, channels); conv_states (slots, channels, kernel-1)
        updated in place; weight (channels, kernel)."""
        out = torch.empty_like(mixed)
        for i in batch.prefills:
            rows = slice(batch.token_starts[i], batch.token_starts[i] + batch.num_new[i])
            out[rows] = conv_prefill(mixed[rows], conv_states[batch.slots[i]], weight)
        if batch.decode_rows.numel():
            out[batch.decode_rows] = conv_decode(mixed[batch.decode_rows], conv_states, batch.decode_slots, weight)
        return out

    def rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             states: torch.Tensor, batch: StateBatch) -> torch.Tensor:  # fmt: skip
        """q, k (tokens, key_heads, dk) before their l2 norm and scale, v (tokens, value_heads, dv), g, beta (tokens,
        value_heads), states (slots, value_heads, dk, dv) updated in place -> (tokens, value_heads, dv) float32."""
        dk = q.shape[-1]
        q = l2norm(q.float()) * dk**-0.5
        k = l2norm(k.float())
        out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        for i in batch.prefills:
            rows = slice(batch.token_starts[i], batch.token_starts[i] + batch.num_new[i])
            slot = batch.slots[i]
            out[rows], states[slot] = chunked_rule(q[rows], k[rows], v[rows], g[rows], beta[rows], states[slot])
        if batch.decode_rows.numel():
            rows, slots = batch.decode_rows, batch.decode_slots
            out[rows], new = recurrent_step(q[rows], k[rows], v[rows], g[rows], beta[rows], states[slots])
            states[slots] = new.to(states.dtype)
        return out

    def warmup(self, conv_states: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, key_heads: int) -> int:
        return 0  # nothing compiles


class TritonDeltaMixer:
    """A batch of decodes only (its rows are its requests) takes the one-token launches and the decode slots; any
    other batch the varlen launches over its table, its decodes among its prefills."""

    name = "triton"

    def conv(self, mixed: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
             batch: StateBatch) -> torch.Tensor:  # fmt: skip
        if not batch.prefills:
            return causal_conv_decode_triton(mixed, conv_states, weight, batch.decode_slots)
        return causal_conv_triton(mixed, conv_states, weight, batch.table)

    def rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             states: torch.Tensor, batch: StateBatch) -> torch.Tensor:  # fmt: skip
        if not batch.prefills:
            return delta_rule_decode_triton(q, k, v, g, beta, states, batch.decode_slots)
        return delta_rule_triton(q, k, v, g, beta, states, batch.table)

    def warmup(self, conv_states: torch.Tensor, states: torch.Tensor, weight: torch.Tensor, key_heads: int) -> int:
        """Compile the four kernels before the first request: a pass of one decode, then one of a decode beside a
        prompt, in slot 0 of a layer's states, on zero inputs laid out as the layer lays them out (their constexprs
        follow the model's sizes and dtypes only, and no token or request count is specialized on). Zero inputs
        leave a zero slot zero, and a request from position 0 zeroes its slot anyway."""
        device, dtype = weight.device, weight.dtype
        value_heads, dk, dv = states.shape[1:]
        for num_new in ([1], [1, 2]):
            batch = StateBatch.of(list(range(len(num_new))), num_new, device)
            num_tokens = sum(num_new)
            mixed = torch.zeros(num_tokens, weight.shape[0], dtype=dtype, device=device)
            q, k, v = self.conv(mixed, conv_states, weight, batch).split([key_heads * dk] * 2 + [value_heads * dv], -1)
            g = torch.zeros(num_tokens, value_heads, device=device)
            beta = torch.zeros(num_tokens, value_heads, dtype=dtype, device=device)
            self.rule(q.view(num_tokens, key_heads, dk), k.view(num_tokens, key_heads, dk),
                      v.view(num_tokens, value_heads, dv), g, beta, states, batch)  # fmt: skip
        return 4


DeltaMixer = TorchDeltaMixer | TritonDeltaMixer


def select_delta_mixer(ops: ModelOps) -> DeltaMixer:
    """The Triton kernels beside the Triton model ops (the worker picks those on CUDA only), else torch ops."""
    return TritonDeltaMixer() if ops.name == "triton" else TorchDeltaMixer()
