"""PEFT adapters as every process reads them: plain Python, no torch.

adapter_config.py    adapter_config.json -> a frozen AdapterConfig, and what is refused (AdapterLoadError with a kind)
adapter_files.py     AdapterFiles: an adapter directory's files, each opened and checked inside --lora-path-root
lora_targets.py      the one table of LoRA target modules (HF names, their order) and how TP splits each
lora_shards.py       which part of each LoRA A/B tensor a TP rank keeps: the workers' cut and node 0's per-rank one
adapter_outcomes.py  merge_outcomes: the all-or-nothing merge of a load answered by several ranks or replicas
"""
