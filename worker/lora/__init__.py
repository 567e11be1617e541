"""Multi-LoRA serving: host copies of adapters, device slot buffers, and the wrappers that add LoRA to the linears.

targets.py   which HF modules LoRA can target, the fused linear each lives in, full shapes and TP split
adapter.py   load_adapter: a PEFT directory -> a validated LoRAAdapter, sliced to this rank (host copy); fused
             targets (qkv_proj, gate_up_proj) split per slice
expert_weights.py  an adapter's MoE expert weights (per-expert modules or target_parameters) stacked per module
pool.py      LoRAPool: zero-padded per-slot A/B buffers per layer per fused linear, slot ranks and scales
dora.py      DoRA: magnitudes, the updated weight's row norms (all-reduced across row-parallel shards), the slot
             tables of row scales LoRALinear applies
layers.py    LoRALinear (wraps a linear: y = base(x) + segmented LoRA via kernels/), LoRABatchInfo
experts.py   LoRAExpertsLinear: an MoE layer's rows regrouped into (expert, slot) runs, virtual slots of the pool
latent.py    LoRALatentKVProj: kv_b_proj's adapter term in latent attention's expanded context and absorbed products
vocab.py     LoRA on embed_tokens and lm_head: their slot buffers and wrappers (torch ops on every backend)
copies.py    ModuleCopies: full embed_tokens/lm_head copies (modules_to_save) under their own budget, a pooling
             classifier's head copies and trainable token rows, selected per row by slot; their wrappers
manager.py   LoRAManager: host copies by lora_id, the slot table, slot loads, per-forward token segments
upload.py    SlotUploader: where the pool's slot writes (uploads, clears) run, chosen once
tower.py     LoRA on a VL model's vision tower and merger (--enable-tower-connector-lora), per image
draft_adapters.py  DraftAdapters: the draft model's adapters (--speculative-lora-modules) in its own pool, by name
"""
