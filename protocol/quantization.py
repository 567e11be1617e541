"""Which quantization a checkpoint is served with: --quantization (vLLM's names) against config.json's
`quantization_config`, decided the same way by the launcher (to exit at start with one line), the frontend
(/server_info) and every worker (to build the layers). A method we do not serve never starts."""

from __future__ import annotations

import json
import os
from typing import Any

from loraplex.protocol.config import ConfigError

SERVED_METHODS = ("fp8", "compressed-tensors", "gptq", "awq", "mxfp4")


def read_hf_config(model_dir: str) -> dict[str, Any]:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def checkpoint_method(hf_config: dict[str, Any]) -> str | None:
    """config.json's quant_method (lower case), None for an unquantized checkpoint."""
    quant = hf_config.get("quantization_config")
    if quant is None:
        return None
    return str(quant.get("quant_method", "<missing quant_method>")).lower()


def resolve_quantization(flag: str, hf_config: dict[str, Any]) -> str | None:
    """The method the checkpoint is served with (None: plain weights); ConfigError names what cannot be served."""
    method = checkpoint_method(hf_config)
    if method is not None and method not in SERVED_METHODS:
        raise ConfigError(f"the checkpoint's quantization_config names quant_method {method!r}, which loraplex does "
                          f"not serve (served: {', '.join(SERVED_METHODS)})")
    if flag == "auto" or flag == (method or "none"):
        return method
    if flag == "none":
        raise ConfigError(f"--quantization none: the checkpoint is quantized with {method}; its weights are not "
                          "plain ones (give --quantization auto)")
    if method is None:
        raise ConfigError(f"--quantization {flag}: the checkpoint has no quantization_config (quantizing a plain "
                          "checkpoint at start-up is not supported)")
    raise ConfigError(f"--quantization {flag}: the checkpoint is quantized with {method}")
