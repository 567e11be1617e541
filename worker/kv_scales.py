"""An FP8 KV cache's static scales as a checkpoint stores them (vLLM, llm-compressor's kv_cache_scheme): one scalar
per attention layer, `...layers.N.self_attn.k_scale` and `.v_scale` (an older form, `.kv_scale`, is both)."""

from __future__ import annotations

import re

import torch
from loraplex.worker.loader import checkpoint_files
from safetensors import safe_open

_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale)$")


def read_kv_scales(model_dir: str, attention_layer_ids: tuple[int, ...]) -> torch.Tensor | None:
    """(cache layers, 2) float32 keys' and values' scales in the cache's layer order (the model's attention layers),
    1.0 where the checkpoint names none; None when it names none at all."""
    index = {layer_id: i for i, layer_id in enumerate(attention_layer_ids)}
    scales = torch.ones(len(attention_layer_ids), 2, dtype=torch.float32)
    found = False
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), no iteration)
                match = _SCALE.search(name)
                if match is None or int(match[1]) not in index:  # a cut or MTP layer: no cache here
                    continue
                value = float(f.get_tensor(name).float().reshape(-1)[0])
                if not value > 0:
                    raise ValueError(f"{name}: an FP8 KV cache scale must be > 0, got {value}")
                parts = {"k_scale": (0,), "v_scale": (1,), "kv_scale": (0, 1)}[match[2]]
                for part in parts:
                    scales[index[int(match[1])], part] = value
                found = True
    return scales if found else None
