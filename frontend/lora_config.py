"""Completes the LoRA part of the config before the workers start: demo adapters, and the pool size inferred
from the start-up adapters when --max-lora-rank / --lora-target-modules are not given (with no start-up adapters,
vLLM's defaults: rank 16, all seven modules)."""

from __future__ import annotations

import json
import os

import msgspec
from loraplex.frontend.demo import DEMO_MODEL_PATH, demo_adapter_paths
from loraplex.protocol.config import DEFAULT_LORA_RANK, TARGET_MODULES, ConfigError, ServerConfig


def read_adapter_config(name: str, path: str) -> dict:
    config_path = os.path.join(path, "adapter_config.json")
    try:
        with open(config_path) as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"adapter {name!r}: no adapter_config.json in {path!r} (not a LoRA adapter)") from e
    except (OSError, ValueError) as e:
        raise ConfigError(f"adapter {name!r}: cannot read {config_path!r}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("r"), int):
        raise ConfigError(f"adapter {name!r}: {config_path!r} has no integer 'r'")
    return data


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
        adapters = [read_adapter_config(s.lora_name, s.lora_path) for s in config.lora_sources]
        if max_rank is None:
            max_rank = max(a["r"] for a in adapters)
        if targets is None:
            wanted = set()
            for a in adapters:
                modules = a.get("target_modules") or []
                wanted.update([modules] if isinstance(modules, str) else modules)
            targets = tuple(m for m in TARGET_MODULES if m in wanted) or TARGET_MODULES
    return msgspec.structs.replace(config, enable_lora=True, max_lora_rank=max_rank,
                                   lora_target_modules=list(targets))
