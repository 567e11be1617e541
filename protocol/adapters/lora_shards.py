"""Which part of each PEFT LoRA weight a tensor-parallel rank keeps: the one rule, applied by a worker that cuts a
whole adapter itself and by node 0 when it sends each rank only its part (--nnodes > 1). Plain integers, no torch,
so both sides (and tests) use it as is."""

from __future__ import annotations

import functools
import re

from loraplex.protocol.adapters.lora_targets import ENCODER_MODULE_PATHS, TP_MODES

# e.g. base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (older PEFT: ...lora_A.default.weight)
_TENSOR_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:\w+\.)*?(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
# an encoder's (BERT): base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.weight
_ENCODER_KEY = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.(" + "|".join(map(re.escape, ENCODER_MODULE_PATHS))
                          + r")\.lora_([AB])(?:\.\w+)?\.weight$")


@functools.lru_cache(maxsize=8192)  # adapters of one base model name their tensors alike
def parse_lora_key(key: str) -> tuple[int, str, str] | None:
    """(layer, HF module, "A" or "B") of a tensor name, or None if it is not a LoRA weight of a decoder layer (or an
    encoder layer, its module then named as a decoder's: lora_targets.ENCODER_MODULE_PATHS)."""
    match = _TENSOR_KEY.search(key)
    if match is not None:
        return int(match[1]), match[2], match[3]
    match = _ENCODER_KEY.search(key)
    return None if match is None else (int(match[1]), ENCODER_MODULE_PATHS[match[2]], match[3])


def rank_cut(key: str, shape: list[int] | tuple[int, ...], tp_rank: int, tp_size: int) -> tuple[int, int, int] | None:
    """(dim, start, length) of the whole tensor `key` of `shape` that TP rank `tp_rank` keeps; None: all of it.
    Defined for any shape (a wrong one is cut too, and refused later on its whole shape), so the sender and the
    receiver of a cut always agree on its size."""
    parsed = parse_lora_key(key)
    # A fused module's tensors (lora_targets.FUSED_TARGETS) travel whole: its B's rank part is one run per slice.
    if tp_size == 1 or parsed is None or parsed[1] not in TP_MODES or len(shape) != 2:
        return None
    _, module, which = parsed
    if (TP_MODES[module], which) == ("column", "B"):
        dim = 0
    elif (TP_MODES[module], which) == ("row", "A"):
        dim = 1
    else:
        return None
    length = shape[dim] // tp_size
    return dim, tp_rank * length, length


def cut_shape(key: str, shape: list[int], tp_rank: int, tp_size: int) -> list[int]:
    """The shape of what rank `tp_rank` keeps of tensor `key` of whole shape `shape`."""
    cut = rank_cut(key, shape, tp_rank, tp_size)
    if cut is None:
        return list(shape)
    dim, _, length = cut
    return [length if i == dim else n for i, n in enumerate(shape)]
