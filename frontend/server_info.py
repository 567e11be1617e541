"""/server_info: the configuration (keys masked), what the processes reported at start, and live counters — the
frontend's own and each replica scheduler's."""

from __future__ import annotations

from typing import Any

import msgspec
from loraplex.frontend.metrics import combine_stats
from loraplex.frontend.request_table import RequestTable
from loraplex.frontend.runtime import Runtime
from loraplex.protocol.spec_stats import spec_info
from loraplex.protocol.structs import SchedulerStats

SECRETS = ("api_key", "admin_api_key", "hf_token")


async def replica_stats(runtime: Runtime) -> list[SchedulerStats] | None:
    """Each replica's counters by dp_rank, or None when they cannot be had (not healthy, a scheduler slow to
    answer): the info routes still render from what the frontend knows."""
    if not runtime.healthy:
        return None
    try:
        return await runtime.replicas.stats()
    except Exception:  # noqa: BLE001 - see above
        return None


async def server_info(runtime: Runtime, requests: RequestTable) -> dict[str, Any]:
    config = msgspec.to_builtins(runtime.config)
    for secret in SECRETS:
        config[secret] = None if config[secret] is None else "***"
    ready = runtime.ready
    replicas = await replica_stats(runtime)
    capacities = [r.max_total_tokens for r in runtime.replica_ready]
    stats = combine_stats(replicas, capacities) if replicas else None
    return {
        **config,
        "model_dir": runtime.model_dir,
        # the commit served: a Hub id's resolved revision, an HF-cache snapshot's; None for a plain directory
        "revision": runtime.model_files.revision if runtime.model_files else None,
        "served_model_name": runtime.config.model_name,
        "quantization": runtime.quantization,  # the method in use (config.json's), None for plain weights
        "max_total_tokens": sum(capacities) if ready else None,  # over all replicas
        "context_length": ready.context_length if ready else None,
        "vocab_size": ready.vocab_size if ready else None,
        "model_type": ready.model_type if ready else None,
        "num_hidden_layers": ready.num_hidden_layers if ready else None,  # after --hf-overrides
        "kv_bytes_per_token": ready.kv_bytes_per_token if ready else None,  # one rank's cache, every layer
        # what prompts may hold: ["text"], or ["text", "image"] for a model that takes images (frontend/multimodal/)
        "modalities": runtime.images.modalities if runtime.images else ["text"],
        "lora_enabled": runtime.config.lora_enabled,
        "max_lora_rank": ready.max_lora_rank if ready else None,
        "lora_target_modules": ready.lora_target_modules if ready else None,
        "process_ids": runtime.procs.pids() if runtime.procs else {},
        "healthy": runtime.healthy,
        # internal counters: leak checks read these
        "num_requests_in_flight": len(requests),
        "num_adapter_entries": runtime.registry.num_entries(),
        "num_adapter_holds": runtime.registry.total_holds(),
        "slot_lora_ids": stats.slot_lora_ids if stats and len(replicas) == 1 else None,  # per replica below
        "speculative": spec_info(runtime.config, replicas, {e.lora_id: e.name for e in runtime.registry.live()},
                                 [e.name for e in runtime.registry.live() if e.draft_path and not e.draining]),
        **scheduler_counters(stats),
        "replicas": [replica_info(runtime, dp_rank, replicas[dp_rank] if replicas else None)
                     for dp_rank in range(len(runtime.replica_ready))],
    }


def replica_info(runtime: Runtime, dp_rank: int, stats: SchedulerStats | None) -> dict[str, Any]:
    """One replica's row: its scheduler's counters and what the router sent it."""
    return {
        "dp_rank": dp_rank,
        "max_total_tokens": runtime.replica_ready[dp_rank].max_total_tokens,
        "num_requests_in_flight": runtime.router.loads[dp_rank],
        "num_requests_routed": runtime.router.num_routed[dp_rank],
        **scheduler_counters(stats),
        "slot_lora_ids": stats.slot_lora_ids if stats else None,
        "num_loaded_adapters": stats.num_loaded_adapters if stats else None,
    }


def scheduler_counters(stats: SchedulerStats | None) -> dict[str, Any]:
    """A scheduler's live counters (None before its first report); hybrid models' linear-attention state slots
    beside the KV pages, and their prefix cache's state snapshots (0 and 0 for other models)."""
    return {
        "num_running": stats.num_running if stats else None,
        "num_waiting": stats.num_waiting if stats else None,
        "kv_usage": stats.kv_usage if stats else None,
        "num_preemptions": stats.num_preemptions if stats else None,
        "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens if stats else None,
        "state_slots_total": stats.num_state_slots if stats else None,
        "state_slots_free": stats.num_free_state_slots if stats else None,
        "state_snapshots_total": stats.num_state_snapshots if stats else None,
        "state_snapshots_free": stats.num_free_state_snapshots if stats else None,
    }
