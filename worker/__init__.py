"""The worker process: one tensor-parallel rank holding a model shard, its KV cache, and the forward pass.

__main__.py / process.py   `python -m worker`: start-up, ready report, the recv -> forward -> reply loop
dist.py                    global rank, device, dtype, torch.distributed group (gloo on CPU, nccl on CUDA)
parallel.py                tensor-parallel state read by layers at construction; the all-reduce
model_runner.py            ModelRunner: model + KV cache + sampler; forward(ForwardBatch) -> next tokens
batch_inputs.py            ForwardBatch -> flat token ids, positions, cache slots, attention masks
kv_cache.py                KVCache tensors and the default capacity rule
state_cache.py             HybridCache: a hybrid model's KV (attention layers only) and its state slots (per running
                           request: each linear-attention layer's recurrent and conv state), bound per pass
loader.py                  safetensors checkpoint -> parameters, via each parameter's weight_loader
dummy_weights.py           --load-format dummy: seeded random weights through the same weight loaders
sampler.py                 greedy / temperature / top-k / top-p, stateless per-request seeds
model/config.py            ModelConfig from an HF config.json (transformers 4 and 5 forms)
model/llama.py             Llama / Mistral / Qwen2 decoder, free of TP and LoRA
model/phi3.py              Phi-3 / Phi-4-mini: the Llama decoder; fused checkpoints, partial rotary, longrope
model/qwen3.py             Qwen3: the Llama decoder with per-head q/k RMSNorm (Qwen3Attention, reusable)
model/mixtral.py           Mixtral: the Llama decoder with the MoE block as its MLP (MoEMLP, reusable)
model/olmoe.py             OLMoE: q/k RMSNorm over the whole projections (summed over TP ranks), MoE without renorm
model/qwen3_moe.py         Qwen3-MoE: Qwen3Attention and the MoE block; dense MLPs where the config says
model/deepseek_v3.py       DeepSeek-V3 / Kimi K2: latent attention (absorbed; the cache holds latent + rope key), MoE
                           with a grouped sigmoid router and shared experts, the first layers dense
model/qwen3_5.py           Qwen3.5 (text, MoE): hybrid Gated DeltaNet + gated attention layers, state in HybridCache
model/qwen3_next.py        Qwen3-Next: Qwen3.5's decoder with grouped in_proj_qkvz / in_proj_ba, MoE + shared expert
model/registry.py          model_type -> decoder class (one file per family)
layers/linear.py           Column-, MergedColumn- and RowParallelLinear with sharding weight loaders
layers/attention.py        paged attention with torch SDPA
layers/rotary.py, norm.py, embedding.py   RoPE (default, linear, dynamic, yarn, longrope, llama3; partial),
                           RMSNorm, replicated embedding / LM head
layers/moe.py              MoE block: router top-k (softmax, or DeepSeek's grouped sigmoid), stacked experts
                           (ExpertsLinear) sharded like the dense MLP; a sigmoid-gated shared expert (Qwen3-Next, 3.5)
layers/gated_delta.py      Gated DeltaNet's ops: causal conv with state; the delta rule, chunked (prefill) and recurrent
layers/sharded_norm.py     RMSNorm over a TP-sharded feature dimension (OLMoE's q/k norm)
layers/ops.py              the model ops (RMSNorm + residual, rotary, SiLU-mul) chosen at start-up: Triton on CUDA
quant/                     quantized checkpoints (FP8, compressed-tensors, GPTQ, AWQ): formats decoded into integer or
                           FP8 weights with scales, sharded per linear, multiplied by torch's CPU int8/int4 kernels or
                           dequantized per tile; see quant/__init__.py
lora/                      multi-LoRA: adapter loading and validation, the device slot pool, LoRALinear wrappers,
                           LoRAManager (host copies, slot loads, per-forward token segments); see lora/__init__.py
"""
