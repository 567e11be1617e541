"""Completes the LoRA part of the config before the workers start: demo adapters, and the pool size inferred
from the start-up adapters (a Hub or S3 one fetched into the adapter cache first) when --max-lora-rank /
--lora-target-modules are not given (with no start-up adapters, vLLM's defaults: rank 16, all seven modules)."""

from __future__ import annotations

import msgspec
from loraplex.frontend.adapters.files import read_adapter_config
from loraplex.frontend.adapters.sources import SourceError, cache_for, parse_remote
from loraplex.frontend.demo import DEMO_MODEL_PATH, demo_adapter_paths
from loraplex.protocol.adapters.adapter_config import AdapterConfig, AdapterLoadError
from loraplex.protocol.adapters.lora_targets import ALL_TARGETS, TARGET_MODULES
from loraplex.protocol.config import DEFAULT_LORA_RANK, ConfigError, ServerConfig


def _start_up_config(config: ServerConfig, name: str, path: str) -> AdapterConfig:
    try:
        remote = parse_remote(path)
        if remote is not None:  # a Hub or S3 adapter: fetched into the adapter cache, where its load finds it
            return read_adapter_config(name, cache_for(config.lora_cache_dir, config.lora_cache_max_gb).fetch(remote))
        return read_adapter_config(name, path, config.lora_path_root)
    except (AdapterLoadError, SourceError) as e:
        raise ConfigError(f"adapter {name!r}: {e}") from e


def resolve_lora_config(config: ServerConfig, model_dir: str) -> ServerConfig:
    lora_paths = list(config.lora_paths)
    if config.model_path == DEMO_MODEL_PATH and not lora_paths and not config.lora_modules:
        lora_paths = [f"{name}={path}" for name, path in demo_adapter_paths(model_dir).items()]
    config = msgspec.structs.replace(config, lora_paths=lora_paths)
    if not config.lora_enabled:
        return config
    max_rank, targets = config.max_lora_rank, config.target_modules
    if max_rank is None or targets is None:
        if not config.lora_sources:
            return msgspec.structs.replace(config, enable_lora=True, max_lora_rank=max_rank or DEFAULT_LORA_RANK,
                                           lora_target_modules=list(targets or TARGET_MODULES))
        adapters = [_start_up_config(config, s.lora_name, s.lora_path) for s in config.lora_sources]
        if max_rank is None:
            max_rank = max(a.max_rank for a in adapters)
        if targets is None:
            wanted = {m for a in adapters for m in a.target_modules}
            targets = tuple(m for m in ALL_TARGETS if m in wanted)
    return msgspec.structs.replace(config, enable_lora=True, max_lora_rank=max_rank,
                                   lora_target_modules=list(targets))
