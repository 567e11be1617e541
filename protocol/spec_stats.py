"""Speculative decoding's counts as the frontend shows them: per adapter name, summed over replicas, with the
acceptance rate (accepted / drafted) and the mean accepted length (tokens a verify pass yields: accepted + 1)."""

from __future__ import annotations

from typing import Any

from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import SchedulerStats, SpecCount

BASE_LABEL = "base"  # the adapter label of the base model's requests


def combine_spec(replicas: list[SchedulerStats]) -> list[SpecCount]:
    """Every replica's counts, summed per adapter id."""
    totals: dict[int | None, list[int]] = {}
    for replica in replicas:
        for count in replica.spec:
            total = totals.setdefault(count.lora_id, [0, 0, 0])
            total[0] += count.num_draft_tokens
            total[1] += count.num_accepted_tokens
            total[2] += count.num_verify_passes
    return [SpecCount(lora_id=lora_id, num_draft_tokens=t[0], num_accepted_tokens=t[1], num_verify_passes=t[2])
            for lora_id, t in totals.items()]  # fmt: skip


def adapter_label(lora_id: int | None, names: dict[int, str]) -> str:
    """The base model's label, an adapter's name, or its id once it is unloaded (its counts stay)."""
    if lora_id is None:
        return BASE_LABEL
    return names.get(lora_id, f"id:{lora_id}")


def spec_info(config: ServerConfig, replicas: list[SchedulerStats] | None, names: dict[int, str],
              loaded_drafts: list[str] = ()) -> dict[str, Any]:  # fmt: skip
    """/server_info's "speculative": the settings (the draft model's adapters by the names of their target adapters:
    --speculative-lora-modules, then `loaded_drafts`, those loaded with their adapter's draft_lora_path), and per
    adapter the counts and the rates made of them."""
    spec = config.speculation
    if spec is None:
        return {"method": None, "adapters": []}
    adapters = []
    for count in combine_spec(replicas or []):
        adapters.append({
            "adapter": adapter_label(count.lora_id, names),
            "num_draft_tokens": count.num_draft_tokens,
            "num_accepted_tokens": count.num_accepted_tokens,
            "num_verify_passes": count.num_verify_passes,
            "acceptance_rate": count.num_accepted_tokens / max(1, count.num_draft_tokens),
            "mean_accepted_length": 1 + count.num_accepted_tokens / max(1, count.num_verify_passes),
        })  # fmt: skip
    return {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens, "adapters": adapters,
            "draft_adapters": list(dict.fromkeys([s.lora_name for s in config.draft_lora_sources] + loaded_drafts))}
