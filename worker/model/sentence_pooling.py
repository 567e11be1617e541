"""How a sentence-transformers checkpoint turns hidden states into one vector per text: modules.json's Pooling
module (its config: one mode of cls / mean / max / mean_sqrt_len_tokens / lasttoken) and an optional Normalize
module after it. Read once at start-up beside config.json; the model applies it to each sequence's rows."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len_tokens", "lasttoken")
# sentence-transformers 2-5's flags in 1_Pooling/config.json -> the mode (6 names one `pooling_mode`)
_MODE_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_MODULE_KINDS = ("Transformer", "Pooling", "Normalize")


class SentencePoolingError(ValueError):
    pass


@dataclass(frozen=True)
class SentencePooling:
    mode: str  # one of POOLING_MODES
    normalize: bool  # a Normalize module follows: each vector scaled to unit L2 norm

    @classmethod
    def from_dir(cls, model_dir: str) -> SentencePooling | None:
        """The checkpoint's pooling, or None when it has no modules.json (not a sentence-transformers model)."""
        path = os.path.join(model_dir, "modules.json")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            modules = json.load(f)
        kinds = [str(module.get("type", "")).rpartition(".")[2] for module in modules]
        unknown = [kind for kind in kinds if kind not in _MODULE_KINDS]
        if unknown or "Pooling" not in kinds:
            raise SentencePoolingError(f"modules.json: modules {unknown or kinds} are not supported; a Transformer, "
                                       "a Pooling and optionally a Normalize module are")  # fmt: skip
        pooling_dir = modules[kinds.index("Pooling")].get("path") or ""
        with open(os.path.join(model_dir, pooling_dir, "config.json")) as f:
            mode = _read_mode(json.load(f))
        return cls(mode=mode, normalize="Normalize" in kinds)

    def pool(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """(tokens, hidden) of whole sequences, in order -> (seqs, hidden), in float32."""
        rows = hidden.float().split(seq_lens)  # each (len, hidden)
        if self.mode == "cls":
            out = torch.stack([r[0] for r in rows])
        elif self.mode == "lasttoken":
            out = torch.stack([r[-1] for r in rows])
        elif self.mode == "max":
            out = torch.stack([r.max(dim=0).values for r in rows])
        else:
            out = torch.stack([r.sum(dim=0) for r in rows])
            counts = torch.tensor(seq_lens, dtype=out.dtype, device=out.device)[:, None]
            out = out / (counts.sqrt() if self.mode == "mean_sqrt_len_tokens" else counts)
        return F.normalize(out, p=2, dim=-1) if self.normalize else out


def _read_mode(config: dict[str, Any]) -> str:
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for flag, mode in _MODE_FLAGS.items() if config.get(flag)]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise SentencePoolingError(f"pooling mode {modes}: one of {', '.join(POOLING_MODES)} is supported")
    if config.get("include_prompt") is False:
        raise SentencePoolingError("pooling with include_prompt false (a prompt's tokens left out) is not supported")
    return modes[0]


def normalized_scores(logits: torch.Tensor) -> torch.Tensor:
    """A classifier's (seqs, labels) logits -> scores as sentence-transformers' CrossEncoder gives them by default:
    the sigmoid of a single label (a relevance score), the softmax over several (class probabilities)."""
    logits = logits.float()
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)

