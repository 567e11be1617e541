"""The worker process: one tensor-parallel rank holding a model shard, its KV cache, and the forward pass.

__main__.py / process.py   `python -m loraplex.worker`: start-up, ready report, the recv -> forward -> reply loop
dist.py                    global rank, device, dtype, torch.distributed group (gloo on CPU, nccl on CUDA)
parallel.py                tensor-parallel state read by layers at construction (expert parallelism on or off);
                           the all-reduce and the all-to-all
model_runner.py            ModelRunner: model + KV cache + sampler; forward(ForwardBatch) -> next tokens
pooling.py                 Pooler: the pooling runner's last/mean/first-token pooling, head and normalisation
speculative.py             speculative decoding's verify step: drafts accepted (greedy or rejection sampling)
draft_model.py             DraftRunner: a small model beside the target proposing drafts on the target's pages, each
                           request with its adapter's namesake among the draft adapters
eagle3_runner.py           Eagle3Runner: an EAGLE-3 head drafting from the target's hidden states (hooks on three
                           layers), its KV on the target's pages, each request's verified features kept between passes
cuda_graphs.py             DecodeGraphRunner: decode steps replayed from CUDA graphs captured at start-up
batch_inputs.py            ForwardBatch -> flat token ids, positions (M-RoPE rows too), cache slots, attention masks
images.py                  a pass's images -> the tower's embedding rows for their placeholders (kept across chunks)
image_blocks.py            Gemma 4's image runs seen whole on its sliding layers (re-attended over the cache; Gemma 3's
                           images: layers/attention.py's mask)
kv_cache.py                KVCache tensors and the default capacity rule; an FP8 cache's scales, writes, dequantizing
kv_scales.py               an FP8 KV cache's static k_scale / v_scale read from the checkpoint
state_cache.py             HybridCache: a hybrid model's KV (attention layers only) and its state slots (per running
                           request: each linear-attention layer's recurrent and conv state), bound per pass, and
                           the prefix cache's snapshots of them
adapter_loader.py          AdapterLoader: reads, validates and installs adapters while the main loop runs forwards
loader.py                  safetensors checkpoint -> parameters, via each parameter's weight_loader
dummy_weights.py           --load-format dummy: seeded random weights through the same weight loaders
sampler.py                 greedy / temperature / top-k / top-p, stateless per-request seeds
sampling_table.py          SamplingTable: each request's SamplingParams on this rank, kept between its passes
sampling_batch.py          SamplingBatch: one pass's sampling parameters row by row, and their tensors
penalties.py               presence / frequency / repetition penalties, min_new_tokens (logits from request state)
grammar.py                 structured output: one xgrammar matcher per constrained request, its token mask
model/config.py            ModelConfig from an HF config.json (transformers 4 and 5 forms)
model/llama.py             Llama / Mistral / Qwen2 decoder, free of TP and LoRA
model/eagle3.py            EAGLE-3 draft head (LlamaForCausalLMEagle3): one layer over embedding | feature
model/bert.py              BERT: a bidirectional encoder (post-LN, GELU) for embeddings and cross-encoders
model/phi3.py              Phi-3 / Phi-4-mini: the Llama decoder; fused checkpoints, partial rotary, longrope
model/qwen3.py             Qwen3: the Llama decoder with per-head q/k RMSNorm (Qwen3Attention, reusable)
model/mixtral.py           Mixtral: the Llama decoder with the MoE block as its MLP (MoEMLP, reusable)
model/olmoe.py             OLMoE: q/k RMSNorm over the whole projections (summed over TP ranks), MoE without renorm
model/qwen3_moe.py         Qwen3-MoE: Qwen3Attention and the MoE block; dense MLPs where the config says
model/gemma2.py            Gemma 2: Llama's attention and fused linears, with Gemma's pieces around them
model/gemma3.py            Gemma 3: Gemma 2's with per-head q/k RMSNorms, local layers' own rope; image rows in place
model/gemma3_vision.py     Gemma 3's SigLIP vision tower and multi-modal projector, TP-sharded
model/gemma4.py            Gemma 4: per-layer head widths, KV sharing, per-layer inputs, a dense MLP beside experts;
                           image rows in place
model/gemma4_vision.py     Gemma 4's vision tower (2-D rotary, clippable linears, k x k pooling) and embedder, TP-split
model/deepseek_v3.py       DeepSeek-V3 / Kimi K2: latent attention (cache of latent + rope key; prefills expanded,
                           decodes absorbed), MoE with a grouped sigmoid router and shared experts, first layers dense
model/glm4_moe.py          GLM-4.5 / 4.6: DeepSeek-V3's MoE (grouped sigmoid router, shared experts, dense first
                           layers) with GQA attention: q/k/v biases, partial rotary, optional per-head q/k norms
model/qwen3_5.py           Qwen3.5 (text, MoE): hybrid Gated DeltaNet + gated attention layers, state in HybridCache
model/qwen3_next.py        Qwen3-Next: Qwen3.5's decoder with grouped in_proj_qkvz / in_proj_ba, MoE + shared expert
model/gpt_oss.py           gpt-oss: attention sinks, biased top-k-softmax router, experts with biases, clamped SwiGLU
model/llama4.py            Llama 4 (text): chunked local attention on RoPE layers, NoPE global layers with temperature
                           tuning, QK L2 norm; sigmoid top-1 experts fed their weight, a shared expert, dense layers
model/llama4_vision.py     Llama 4's vision model (tiles, 2-D rotary, pixel shuffle) and projector, TP-sharded
model/image_rows.py        ImageRowsForward: a vision-language model's forward, the pass's image rows to its decoder
model/qwen2_5_vl.py        Qwen2.5-VL: a Qwen2 decoder with M-RoPE whose image placeholders take the tower's rows
model/qwen2_5_vl_vision.py  Qwen2.5-VL's vision tower (windowed and full blocks, 2-D rotary, patch merger), TP-sharded
model/qwen3_vl.py          Qwen3-VL: a Qwen3 decoder with interleaved M-RoPE; image rows in place, deepstack rows added
model/qwen3_vl_vision.py   Qwen3-VL's vision tower (learned positions resampled, 2-D rotary, merger, deepstack mergers)
model/registry.py          model_type -> decoder class (one file per family)
layers/linear.py           Column-, MergedColumn- and RowParallelLinear with sharding weight loaders
layers/attention.py        paged attention with torch SDPA; a batch's decodes and prefills as parts (latent attention)
layers/attention_spec.py   what differs between one model's attention layers, as every attention backend reads it
layers/triton_attention.py  the `triton` attention backend: paged decode and extend kernels
layers/rotary.py           RoPE (default, linear, dynamic, yarn, longrope, llama3; partial)
layers/norm.py             RMSNorm
layers/embedding.py        replicated embedding / LM head
layers/activation.py       SiluAndMul of a fused [gate | up] projection
layers/packed.py           linear weights prepacked for oneDNN (CPU, bfloat16)
layers/moe.py              MoE block: router top-k (softmax, or DeepSeek's grouped sigmoid), stacked experts
                           (ExpertsLinear) sharded like the dense MLP; a sigmoid-gated shared expert (Qwen3-Next, 3.5)
layers/expert_weights.py   how stacked experts hold their weights: plain, MXFP4, or a linear format's FP8 / packed
                           integers per expert, each dequantized at its matmul
layers/expert_parallel.py  ExpertDispatcher: --enable-expert-parallel's dispatch of rows to the ranks holding their
                           experts and combine of the outputs, by all-to-all
layers/gated_delta.py      Gated DeltaNet's ops: causal conv with state; the delta rule, chunked (prefill) and recurrent
layers/delta_mixer.py      a DeltaNet layer's conv and delta rule over a batch: Triton kernels on CUDA, else torch ops
layers/sharded_norm.py     RMSNorm over a TP-sharded feature dimension (OLMoE's q/k norm)
layers/ops.py              the model ops (RMSNorm + residual, rotary, SiLU-mul) chosen at start-up: Triton on CUDA
quant/                     quantized checkpoints (FP8, compressed-tensors, GPTQ, AWQ): formats decoded into integer or
                           FP8 weights with scales, sharded per linear, multiplied by torch's CPU int8/int4 kernels or
                           dequantized per tile; see quant/__init__.py
lora/                      multi-LoRA: adapter loading and validation, the device slot pool, LoRALinear wrappers,
                           LoRAManager (host copies, slot loads, per-forward token segments); see lora/__init__.py
"""
