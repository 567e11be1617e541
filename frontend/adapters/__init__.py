"""The frontend's side of adapters: which are loaded, the operations that change that, and their files.

registry.py    AdapterRegistry: name -> adapter id/path/pin, in-flight holds, drain on unload, host-memory LRU
manager.py     AdapterManager: load, unload, in-place reload, resolver; a request's hold; deadlines, state file
residency.py   HostResidency: host copies under --max-loaded-loras: ensure (reload, first use), LRU eviction
delivery.py    AdapterDelivery: one load or drop on every rank of every replica (integrity, node 0 reads, rollback)
integrity.py   AdapterIntegrity: the base-model check and the manifest, before any rank reads an adapter
base_names.py  the names an adapter's base model may go by, against the served model's
sources.py     Hub and S3 adapter paths, the download cache, the resolver's remote directory
audit.py       AuditLog: every adapter operation and refusal, who asked and how it ended
state_file.py  AdapterStateFile: --lora-state-file, atomic rewrite, restore
files.py       a start-up adapter's config; a directory as tensor frames (node 0); torch tensors as specs and frames
strength.py    a request's adapter strength (lora_scale): checked per item
mixes.py       AdapterMixes: a request's lora_mix checked, computed once and loaded as an adapter of its own
mix_merge.py   a mix's PEFT tensors from its adapters' (linear: stacked ranks; PEFT's ties and dare_linear)
tokenizers.py  AdapterTokenizers: an adapter's own tokenizer (added tokens, chat template) read at its load
"""
