"""Phi-3 and Phi-4-mini (model_type phi3): the Llama decoder, layer for layer (pre-norm blocks, SiLU-gated MLP, no
biases); the differences lie elsewhere:
  checkpoints  store qkv_proj and gate_up_proj fused; each loads whole and is cut per slice (layers/linear.py);
  rope         partial rotary (Phi-4-mini rotates 3/4 of each head) and longrope (layers/rotary.py);
  adapters     PEFT targets the fused modules; their B is split per slice (worker/lora/adapter.py)."""

from __future__ import annotations

from loraplex.worker.model.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    pass
