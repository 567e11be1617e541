"""Read one PEFT LoRA adapter, validate it against the base model and the pool, and keep this rank's shard.

Two sources feed one path: a directory (`load_adapter`: adapter_config.json and the weight file) or a config and
raw tensor buffers sent along (`adapter_from_tensors`); both go through `_check_config`, `_finite_in_dtype` and
`_build` (matching, shape checks, the TP slice). Runs on the worker's loader thread: it touches no shared state, and
every refusal is an AdapterLoadError whose message names the cause (the HTTP layer passes it on to the user as is).
The directory's layout and its confinement to --lora-path-root are protocol/adapters/adapter_files.py's, the config's
rules protocol/adapters/adapter_config.py's (node 0's frontend reads adapters by the same two); every file is checked
where the open file really lies, so a reload of an evicted adapter is checked again."""

from __future__ import annotations

import math
import mmap
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from loraplex.protocol.adapters.adapter_config import (
    HEAD_MODULES,
    AdapterConfig,
    AdapterLoadError,
    parse_adapter_config,
)
from loraplex.protocol.adapters.adapter_files import AdapterFiles
from loraplex.protocol.adapters.lora_shards import cut_shape, parse_lora_key, rank_cut
from loraplex.protocol.adapters.lora_targets import FUSED_TARGETS, LAYER_MODULES, MLP_MODULES, MODEL_TARGETS, TP_MODES
from loraplex.protocol.structs import TensorSpec
from loraplex.worker.lora.dora import DoraNorms, check_dora_targets, is_magnitude_key, lora_key_of
from loraplex.worker.lora.expert_weights import is_expert_key, match_expert_tensors
from loraplex.worker.lora.targets import (
    GROUPED_TARGETS,
    SHARED_PREFIX,
    full_shapes,
    is_expert_module,
    layer_has_module,
    slice_order_rows,
)
from loraplex.worker.lora.tower import TOWER_FLAG, is_tower_key, siglip_leaves, tower_weights
from loraplex.worker.model.config import Llama4VisionConfig, ModelConfig, VisionConfig
from safetensors import safe_open
from safetensors.torch import load_file


@dataclass(frozen=True)
class PoolSpec:
    """What the device pool can hold, and where: every adapter is checked against it before it is kept."""

    max_lora_rank: int
    target_modules: tuple[str, ...]  # HF module names, in TARGET_MODULES order
    dtype: torch.dtype
    device: torch.device  # host copies are pinned when it is a CUDA device (async slot loads)
    # --enable-expert-parallel: an MoE layer's pool rows hold this rank's experts, whole (worker/layers/moe.py)
    expert_parallel: bool = False
    # --enable-tower-connector-lora on a vision-language model: its tower, whose linears adapters may reach
    # (worker/lora/tower.py); None: an adapter that targets it is refused
    tower: VisionConfig | Llama4VisionConfig | None = None


@dataclass(frozen=True)
class LoRAAdapter:
    lora_id: int
    lora_rank: int  # r (the largest of any module, with a rank_pattern)
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    target_modules: tuple[str, ...]  # in TARGET_MODULES order
    # (layer, HF module) -> (A (r, in of this rank), B (out of this rank, r)): host tensors in the model dtype; an MoE
    # layer's MLP modules stacked over experts: (experts, r, in of this rank), (experts, out of this rank, r). A
    # module whose rank or alpha a pattern sets has its own r, and its scale over `scale` folded into B.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # embed_tokens / lm_head -> (A (r, in), B (out, r)), whole on every rank (the embedding's in is the vocabulary)
    vocab_weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # DoRA: the magnitudes by (layer, HF module), this rank's rows (the manager adds the norms: worker/lora/dora.py)
    dora: DoraNorms | None = None
    # modules_to_save: embed_tokens / lm_head -> the adapter's full copy (vocab, hidden); a classifier's head (score,
    # classifier, pooler.dense) -> its weight, and copy_bias(module) -> its bias; whole on every rank
    module_copies: dict[str, torch.Tensor] = field(default_factory=dict)
    # trainable_token_indices: (token ids (k,) int64, their rows (k, hidden)) replacing the embedding's rows
    token_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    # --enable-tower-connector-lora: the vision tower's modules (ours) -> (A, B) of this rank (worker/lora/tower.py)
    tower_weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        pairs = [*self.weights.values(), *self.vocab_weights.values(), tuple(self.module_copies.values()),
                 self.token_rows or (), *self.tower_weights.values()]  # fmt: skip
        return sum(t.numel() * t.element_size() for pair in pairs for t in pair)


@dataclass(frozen=True)
class _Config:
    parsed: AdapterConfig
    layers: tuple[int, ...]  # layers that must carry weights for every target

    @property
    def lora_rank(self) -> int:
        return self.parsed.max_rank

    @property
    def target_modules(self) -> tuple[str, ...]:
        return self.parsed.target_modules


def load_adapter(
    path: str,
    lora_id: int,
    model_config: ModelConfig,
    pool_spec: PoolSpec,
    tp_rank: int,
    tp_size: int,
    *,
    lora_name: str = "",
    path_root: str | None = None,
) -> LoRAAdapter:
    """`path_root` (--lora-path-root or --lora-resolver-dir): every file read must lie inside it, symlinks
    resolved; `lora_name` is for the messages."""
    files = AdapterFiles.under(lora_name, path_root)
    config = _check_config(files.read_config(path), model_config, pool_spec)
    tensors = _read_tensors(path, pool_spec.dtype, files)
    return _build(lora_id, config, tensors, model_config, pool_spec, tp_rank, tp_size)


def adapter_from_tensors(
    config: Any,
    tensor_specs: Sequence[TensorSpec],
    buffers: Sequence[Any],
    lora_id: int,
    model_config: ModelConfig,
    pool_spec: PoolSpec,
    tp_rank: int,
    tp_size: int,
    *,
    is_cut: bool = False,
) -> LoRAAdapter:
    """An adapter from adapter_config.json's content and its tensors' raw bytes (one buffer per spec, in order),
    checked exactly as a directory load is. `is_cut`: each buffer holds only this rank's part of its tensor
    (protocol/adapters/lora_shards.py; node 0 cut it), while the spec still names the whole tensor."""
    checked = _check_config(config, model_config, pool_spec)
    tensors = _tensors_from_buffers(tensor_specs, buffers, (tp_rank, tp_size) if is_cut else None)
    whole_shapes = {spec.name: tuple(spec.shape) for spec in tensor_specs} if is_cut else None
    tensors = _finite_in_dtype(tensors, pool_spec.dtype)
    return _build(lora_id, checked, tensors, model_config, pool_spec, tp_rank, tp_size, whole_shapes)


def _build(
    lora_id: int,
    config: _Config,
    tensors: dict[str, torch.Tensor],
    model_config: ModelConfig,
    pool_spec: PoolSpec,
    tp_rank: int,
    tp_size: int,
    whole_shapes: dict[str, tuple[int, ...]] | None = None,
) -> LoRAAdapter:
    """Match the tensors (already in the pool's dtype, finite) to the config and the model, keep this rank's slice.
    `whole_shapes`: set when `tensors` are already this rank's slices; the whole tensors' shapes, checked instead."""
    tower_tensors = {key: t for key, t in tensors.items() if is_tower_key(key)}
    if tower_tensors and pool_spec.tower is None:
        raise AdapterLoadError(f"tensor {next(iter(tower_tensors))!r} targets the vision tower or its merger; "
                               f"serve with {TOWER_FLAG} to load such an adapter")  # fmt: skip
    if tower_tensors and whole_shapes is not None:
        raise AdapterLoadError("vision tower adapters cannot be sent cut per rank (--nnodes > 1) yet")
    tensors = {key: t for key, t in tensors.items() if key not in tower_tensors}

    def tower_scale(key: str) -> tuple[int, float]:
        r, alpha = config.parsed.module_rank_alpha(_module_name(key))
        return r, config.parsed.module_scale(r, alpha)

    tower = tower_weights(tower_tensors, pool_spec.tower, tower_scale, tp_rank, tp_size) if tower_tensors else {}
    expert_tensors = {key: t for key, t in tensors.items() if is_expert_key(key)}
    if expert_tensors and whole_shapes is not None:
        raise AdapterLoadError("MoE expert adapters cannot be sent cut per rank (--nnodes > 1) yet")
    magnitudes = {key: t for key, t in tensors.items() if is_magnitude_key(key)}
    copy_tensors = tensors  # the copies and token rows, whole on every rank (replicated layers)
    tensors = {key: t for key, t in tensors.items() if key not in expert_tensors and key not in magnitudes}
    shapes = {key: shape for key, shape in whole_shapes.items() if key in tensors} if whole_shapes else \
        {key: tuple(t.shape) for key, t in tensors.items()}  # fmt: skip
    copy_keys, token_keys = _match_copies(shapes, config.parsed, model_config)
    tensors = {key: t for key, t in tensors.items() if key not in copy_keys.values() and key not in token_keys}
    shapes = {key: shape for key, shape in shapes.items() if key in tensors}
    tensors, shapes, fused_keys = _split_fused(tensors, shapes, model_config)
    vocab_pairs = _match_vocab_tensors(shapes, config, model_config)  # every tensor of these layers, or it raised
    vocab_keys = {key for pair in vocab_pairs.values() for key in pair[:2]}
    pairs = _match_tensors({k: v for k, v in shapes.items() if k not in vocab_keys}, config, model_config, fused_keys)
    expert_pairs = match_expert_tensors(expert_tensors, config.parsed, model_config) if expert_tensors else {}
    _check_complete(set(pairs) | set(expert_pairs), config, model_config)
    dora = _match_magnitudes(magnitudes, set(pairs), config, model_config, tp_rank, tp_size, expert_pairs)
    pin = pool_spec.device.type == "cuda" and torch.cuda.is_available()

    def keep(key: str) -> torch.Tensor:  # already cut by the sender: keep all that came
        is_whole = whole_shapes is None or key in fused_keys
        return _keep(key, tensors[key], *((tp_rank, tp_size) if is_whole else (0, 1)))

    weights = {}
    for (layer, module), (key_a, key_b, module_scale) in pairs.items():
        host_b = _host_copy(_fold_scale(keep(key_b), module_scale, config), pin, tp_size, transposed=True)
        weights[(layer, module)] = (_host_copy(keep(key_a), pin, tp_size), host_b)
    for (layer, module), (lora_a, lora_b) in expert_pairs.items():
        lora_a, lora_b = _keep_experts(module, lora_a, lora_b, tp_rank, tp_size, pool_spec.expert_parallel)
        weights[(layer, module)] = (_host_copy(lora_a, pin, tp_size), _host_copy(lora_b, pin, tp_size, transposed=True))
    vocab_weights = {}
    for module, (key_a, key_b, module_scale) in vocab_pairs.items():  # replicated layers: every rank keeps all of it
        lora_b = _fold_scale(tensors[key_b], module_scale, config)
        vocab_weights[module] = (_host_copy(tensors[key_a], pin, tp_size),
                                 _host_copy(lora_b, pin, tp_size, transposed=True))  # fmt: skip
    return LoRAAdapter(
        lora_id=lora_id,
        lora_rank=config.lora_rank,
        scale=config.parsed.scale,
        # a name only the SigLIP tower has (out_proj) is the tower's (tower_weights), not the language model's
        target_modules=tuple(t for t in config.target_modules
                             if t in pool_spec.target_modules or t not in siglip_leaves(model_config.vision)),
        weights=weights,
        vocab_weights=vocab_weights,
        dora=dora,
        module_copies={module: _host_copy(copy_tensors[key], pin, tp_size) for module, key in copy_keys.items()},
        token_rows=(torch.tensor(config.parsed.trainable_tokens, dtype=torch.int64),
                    _host_copy(copy_tensors[token_keys[0]], pin, tp_size)) if token_keys else None,  # fmt: skip
        tower_weights={name: (_host_copy(a, pin, tp_size), _host_copy(b, pin, tp_size))
                       for name, (a, b) in tower.items()},  # fmt: skip
    )


# ---- adapter_config.json ------------------------------------------------------------------------


def _check_config(raw: Any, model_config: ModelConfig, pool_spec: PoolSpec) -> _Config:
    """The one parse (protocol/adapters/adapter_config.py), then what this server can hold."""
    config = parse_adapter_config(raw)
    if config.tower_modules and pool_spec.tower is None:
        raise AdapterLoadError(f"target_modules {list(config.tower_modules)} are the vision tower's or its merger's; "
                               f"serve with {TOWER_FLAG} to load such an adapter")  # fmt: skip
    if config.max_rank > pool_spec.max_lora_rank:
        raise AdapterLoadError(f"rank {config.max_rank} exceeds --max-lora-rank {pool_spec.max_lora_rank}")
    leaves = siglip_leaves(model_config.vision)
    for target in config.target_modules:
        if target not in pool_spec.target_modules and target in leaves:  # Gemma 3's tower alone has it (out_proj)
            if pool_spec.tower is None:
                raise AdapterLoadError(f"target module {target!r} is the vision tower's; serve with {TOWER_FLAG} to "
                                       "load such an adapter")  # fmt: skip
        elif target not in pool_spec.target_modules:
            raise AdapterLoadError(
                f"target module {target!r} is not in the LoRA pool ({', '.join(pool_spec.target_modules)})"
            )
    return _Config(parsed=config, layers=_check_layers(config, model_config.num_layers))


def _check_layers(config: AdapterConfig, num_layers: int) -> tuple[int, ...]:
    if config.layers is None:
        return tuple(range(num_layers))
    bad = [i for i in config.layers if not 0 <= i < num_layers]
    if bad:
        raise AdapterLoadError(f"layers_to_transform {bad} out of range (the base model has {num_layers} layers)")
    return config.layers


# ---- weights ------------------------------------------------------------------------------------


def _read_tensors(path: str, dtype: torch.dtype, files: AdapterFiles) -> dict[str, torch.Tensor]:
    """The adapter's tensors in `dtype`, as views of one new buffer, each checked finite."""
    weights_path = files.weights_path(path)
    try:
        with files.open(weights_path) as (file, opened_path):
            if weights_path.endswith(".safetensors"):
                mapped = _map_safetensors(opened_path, dtype)
                if mapped is not None:
                    return mapped
                tensors = load_file(opened_path, device="cpu")
            else:
                tensors = torch.load(file, map_location="cpu", weights_only=True)
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise AdapterLoadError(f"{weights_path!r} does not hold a dict of tensors")
    except AdapterLoadError:
        raise
    except Exception as e:  # a truncated or foreign file: safetensors, pickle and zip errors have no common type
        raise AdapterLoadError(f"cannot read the adapter weights in {path!r}: {type(e).__name__}: {e}") from e
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise AdapterLoadError(f"tensor {key!r} has dtype {tensor.dtype}; expected floating point")
    return _finite_in_dtype(tensors, dtype)


_TENSOR_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                  "float64": torch.float64}


def _tensors_from_buffers(
    specs: Sequence[TensorSpec], buffers: Sequence[Any], cut_for: tuple[int, int] | None = None
) -> dict[str, torch.Tensor]:
    """Views of the raw buffers (C order, little-endian), each checked against its spec's dtype and shape.
    `cut_for` (tp_rank, tp_size): each buffer holds that rank's part of the whole tensor its spec names."""
    if len(specs) != len(buffers):
        raise AdapterLoadError(f"{len(buffers)} tensor buffers for {len(specs)} tensors")
    tensors: dict[str, torch.Tensor] = {}
    for spec, buffer in zip(specs, buffers, strict=True):
        dtype = _TENSOR_DTYPES.get(spec.dtype)
        if dtype is None:
            raise AdapterLoadError(
                f"tensor {spec.name!r} has dtype {spec.dtype!r}; expected one of {', '.join(_TENSOR_DTYPES)}"
            )
        if not all(isinstance(n, int) and n >= 0 for n in spec.shape):
            raise AdapterLoadError(f"tensor {spec.name!r} has shape {spec.shape!r}; expected non-negative integers")
        if spec.name in tensors:
            raise AdapterLoadError(f"tensor {spec.name!r} appears twice")
        shape = spec.shape if cut_for is None else cut_shape(spec.name, spec.shape, *cut_for)
        data = memoryview(buffer).cast("B")
        num_elements = math.prod(shape)
        if len(data) != num_elements * dtype.itemsize:
            of_rank = "" if cut_for is None else f", rank {cut_for[0]}'s part of shape {tuple(spec.shape)}"
            raise AdapterLoadError(
                f"tensor {spec.name!r}: {len(data)} bytes, expected {num_elements * dtype.itemsize} "
                f"({spec.dtype}, shape {tuple(shape)}{of_rank})"
            )
        if num_elements == 0:
            tensors[spec.name] = torch.empty(shape, dtype=dtype)
            continue
        with warnings.catch_warnings():  # read-only frames: only read, then copied by _finite_in_dtype
            warnings.filterwarnings("ignore", "The given buffer is not writable")
            tensors[spec.name] = torch.frombuffer(data, dtype=dtype).view(shape)
    return tensors


_SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _map_safetensors(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """The common case, fast: a file whose tensors share one floating dtype is mapped (pages straight from the page
    cache, no read copy) and its whole data section cast into the buffer in one multithreaded copy, where reading
    and casting tensor by tensor costs ~4x as much for an all-module adapter's hundreds of small tensors. None for
    any other file (mixed or non-float dtypes, no tensors): the general path reads it and says what is wrong.

    safetensors parses and validates the header, and refuses one whose tensors do not tile the data section
    exactly in offset order; so each tensor's bytes start where the previous one's end."""
    with safe_open(path, framework="pt") as f:
        keys = f.offset_keys()
        layouts = [(piece.get_dtype(), piece.get_shape()) for piece in map(f.get_slice, keys)]
    source_dtypes = {name for name, _ in layouts}
    if len(source_dtypes) != 1 or (source_dtype := _SAFETENSORS_FLOATS.get(source_dtypes.pop())) is None:
        return None
    sizes = [math.prod(shape) for _, shape in layouts]
    num_elements = sum(sizes)
    with open(path, "rb") as file:
        data_start = 8 + int.from_bytes(file.read(8), "little")  # the header's length, then the header
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    if data_start + num_elements * source_dtype.itemsize != len(mapped):
        return None  # not the layout described above: the general path reads it
    with warnings.catch_warnings():  # read-only memory, and only read below
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        source = torch.frombuffer(mapped, dtype=source_dtype, offset=data_start, count=num_elements)
    buffer = torch.empty(num_elements, dtype=dtype)  # a copy even in the same dtype: the mapping is read-only
    buffer.copy_(source)  # one cast of every tensor, on all threads
    copies = {key: piece.view(shape) for key, piece, (_, shape) in zip(keys, buffer.split(sizes), layouts, strict=True)}
    _check_finite(buffer, copies, dict.fromkeys(keys, source_dtype))
    return copies


def _finite_in_dtype(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Copies of the tensors in `dtype`, views of one buffer; NaN and infinities (also from a cast that overflows)
    refused. An all-module adapter has hundreds of small tensors, where per-tensor ops cost more in call overhead
    than in work: one fused copy-and-cast into the buffer and one sum over it do for all of them. The sum is NaN or
    infinite whenever an element is (or when finite values overflow it: then the exact check decides), and costs a
    twentieth of an isfinite pass."""
    sizes = [t.numel() for t in tensors.values()]
    buffer = torch.empty(sum(sizes), dtype=dtype)
    copies = {key: piece.view(t.shape) for (key, t), piece in zip(tensors.items(), buffer.split(sizes), strict=True)}
    if copies:
        torch._foreach_copy_(list(copies.values()), list(tensors.values()))
    _check_finite(buffer, copies, {key: t.dtype for key, t in tensors.items()})
    return copies


def _check_finite(buffer: torch.Tensor, copies: dict[str, torch.Tensor], source_dtypes: dict[str, torch.dtype]) -> None:
    if torch.isfinite(buffer.sum()):
        return
    for key, copy in copies.items():
        if not torch.isfinite(copy).all():
            cast = "" if source_dtypes[key] == buffer.dtype else f" as {str(buffer.dtype).removeprefix('torch.')}"
            raise AdapterLoadError(f"tensor {key!r} holds NaN or infinite values{cast}")


# PEFT's names: ...model.embed_tokens.lora_embedding_A (no .weight), ...lm_head.lora_A.weight (older PEFT: with the
# adapter's name before .weight); a full copy of the layer (save_embedding_layers): ...embed_tokens.base_layer.weight.
_VOCAB_KEY = re.compile(
    r"(?:^|\.)(embed_tokens|lm_head)\.(?:lora_(?:embedding_)?([AB])(?:\.\w+)*|(base_layer\.)?weight)$"
)


def _match_vocab_tensors(
    tensor_shapes: dict[str, tuple[int, ...]], config: _Config, model_config: ModelConfig
) -> dict[str, tuple[str, str, float]]:
    """The embedding's and the LM head's LoRA tensors, checked: {module: (A's key, B's key, its scale)}. A full copy
    of either layer is refused: it may differ from the base model's."""
    shapes = full_shapes(model_config)
    found: dict[tuple[str, str], str] = {}
    ranks: dict[str, tuple[int, float]] = {}
    for key, shape in tensor_shapes.items():
        match = _VOCAB_KEY.search(key)
        if match is None:
            continue
        module, which, _ = match.groups()
        if which is None:
            raise AdapterLoadError(
                f"tensor {key!r} is a full copy of the base model's {module} (PEFT saves one when the embedding is "
                f"a target, or was resized for added tokens); not supported: save with save_embedding_layers=False"
            )
        if module not in config.target_modules:
            raise AdapterLoadError(f"tensor {key!r} is for {module!r}, which target_modules does not list")
        r, alpha = config.parsed.module_rank_alpha(key[: match.end(1)].removeprefix("base_model.model."))
        in_features, out_features = shapes[module]
        expected = (r, in_features) if which == "A" else (out_features, r)
        if shape != expected:
            vocab = shape[1] if module == "embed_tokens" and which == "A" and len(shape) == 2 else None
            added = f"; {vocab - in_features} added tokens are not supported" if vocab and vocab > in_features else ""
            raise AdapterLoadError(
                f"shape mismatch with the base model: tensor {key!r} has shape {shape}, expected {expected} "
                f"(r={r}, {module} is {in_features} -> {out_features}){added}"
            )
        if (module, which) in found:
            raise AdapterLoadError(f"tensor {key!r}: {module} lora_{which} appears twice")
        found[(module, which)] = key
        ranks[module] = (r, alpha)
    pairs = {}
    for module in config.target_modules:
        if module in MODEL_TARGETS:
            for which in "AB":
                if (module, which) not in found:
                    raise AdapterLoadError(f"missing lora_{which} weight for {module}")
            pairs[module] = (found[(module, "A")], found[(module, "B")], config.parsed.module_scale(*ranks[module]))
    return pairs


# PEFT's names: a modules_to_save copy is saved as the layer's own weight (a head's bias too: the one of
# BERT's pooler is under `bert.pooler.dense`); trainable tokens' rows as token_adapter's.
_COPY_KEY = re.compile(r"(?:^|\.)(embed_tokens|lm_head|score|classifier|pooler\.dense)\.(weight|bias)$")
_TOKEN_ROWS_KEY = re.compile(r"(?:^|\.)embed_tokens\.token_adapter\.trainable_tokens_delta(?:\.\w+)?$")
# LoRA on a classifier's head (PEFT's `dense` reaches BERT's pooler.dense): refused by name
_HEAD_LORA_KEY = re.compile(r"(?:^|\.)(score|classifier|pooler\.dense)\.lora_\w+\.weight$")


def copy_bias(module: str) -> str:
    """The module_copies name of a head copy's bias (its weight's is the module's name)."""
    return f"{module}.bias"


def _match_copies(
    tensor_shapes: dict[str, tuple[int, ...]], config: AdapterConfig, model_config: ModelConfig
) -> tuple[dict[str, str], list[str]]:
    """The full copies modules_to_save lists ({module, or copy_bias(module): key}) and the trainable tokens' rows
    ([key] or []), each checked against the base model's shapes (a head's rows, its labels, against the served head
    when it is installed). A copy of a module modules_to_save does not list is left to _match_vocab_tensors (which
    refuses it)."""
    vocab, hidden = model_config.vocab_size, model_config.hidden_size
    if set(config.modules_to_save) & {"embed_tokens", "lm_head"} and model_config.tie_word_embeddings:
        raise AdapterLoadError(
            f"modules_to_save {list(config.modules_to_save)!r} on a model with tied embeddings is not supported"
        )
    both = [m for m in config.modules_to_save if m in config.target_modules]
    if both:
        raise AdapterLoadError(f"{both!r} is both in modules_to_save and a LoRA target")
    for key in tensor_shapes:
        lora = _HEAD_LORA_KEY.search(key)
        if lora is not None:
            raise AdapterLoadError(f"tensor {key!r}: LoRA on the classifier's {lora.group(1)} is not supported (PEFT's "
                                   "target_modules reach it); list it in modules_to_save instead")  # fmt: skip
    copies: dict[str, str] = {}
    token_keys = []
    for key, shape in tensor_shapes.items():
        match = _COPY_KEY.search(key)
        if match is not None and match.group(1) in config.modules_to_save:
            module, is_bias = match.group(1), match.group(2) == "bias"
            name = copy_bias(module) if is_bias else module
            if is_bias and module not in HEAD_MODULES:
                raise AdapterLoadError(f"tensor {key!r}: a copy of {module} with a bias is not supported")
            if not is_bias:
                _check_copy_shape(key, module, shape, vocab, hidden)
            if name in copies:
                raise AdapterLoadError(f"tensor {key!r}: {name}'s copy appears twice")
            copies[name] = key
        elif _TOKEN_ROWS_KEY.search(key):
            if not config.trainable_tokens:
                raise AdapterLoadError(f"tensor {key!r} holds trainable tokens, but trainable_token_indices is empty")
            expected = (len(config.trainable_tokens), hidden)
            if shape != expected or token_keys:
                raise AdapterLoadError(f"tensor {key!r} has shape {shape}, expected {expected} (once)")
            token_keys.append(key)
    for module in HEAD_MODULES:
        bias = copies.get(copy_bias(module))
        if bias is not None and (module not in copies or tensor_shapes[bias] != tensor_shapes[copies[module]][:1]):
            raise AdapterLoadError(f"tensor {bias!r} (a bias of {module}) has shape {tensor_shapes[bias]}, which does "
                                   f"not fit its weight's")  # fmt: skip
    # PEFT's SEQ_CLS lists each head name a model may have: one of them copied is the head
    listed_heads = [m for m in config.modules_to_save if m in HEAD_MODULES]
    missing = [m for m in config.modules_to_save if m not in copies and m not in HEAD_MODULES]
    if listed_heads and not any(m in copies for m in listed_heads):
        missing += listed_heads
    if missing:
        raise AdapterLoadError(f"modules_to_save lists {missing!r}, but the adapter holds no copy of it")
    if config.trainable_tokens and not token_keys:
        raise AdapterLoadError("trainable_token_indices is set, but the adapter holds no trainable_tokens_delta")
    too_large = [i for i in config.trainable_tokens if i >= vocab]
    if too_large:
        raise AdapterLoadError(f"trainable_token_indices {too_large} are outside the vocabulary ({vocab} tokens)")
    return copies, token_keys


def _check_copy_shape(key: str, module: str, shape: tuple[int, ...], vocab: int, hidden: int) -> None:
    if module in ("score", "classifier"):  # (labels, hidden)
        if len(shape) != 2 or shape[1] != hidden:
            raise AdapterLoadError(f"tensor {key!r} (a copy of {module}) has shape {shape}, expected (labels, "
                                   f"{hidden})")  # fmt: skip
    elif module == "pooler.dense":
        if shape != (hidden, hidden):
            raise AdapterLoadError(f"tensor {key!r} (a copy of {module}) has shape {shape}, expected "
                                   f"{(hidden, hidden)}")  # fmt: skip
    elif shape != (vocab, hidden):
        raise AdapterLoadError(
            f"tensor {key!r} (a copy of {module}) has shape {shape}, expected {(vocab, hidden)}; resized vocabularies "
            "are not supported"
        )


def _match_tensors(
    tensor_shapes: dict[str, tuple[int, ...]], config: _Config, model_config: ModelConfig, fused_keys: dict[str, str]
) -> dict[tuple[int, str], tuple[str, str, float]]:
    """Every tensor must be an A or B of a target module in a layer of the model, with the base model's shape (at the
    module's rank: r, or its rank_pattern's, matched against the fused module's name where `fused_keys` says the
    tensor is a slice of one). Returns the keys of each (layer, module)'s A and B, and its scale."""
    found: dict[tuple[int, str, str], str] = {}
    ranks: dict[tuple[int, str], tuple[int, float]] = {}
    for key, shape in tensor_shapes.items():
        parsed = parse_lora_key(key)
        if parsed is None:
            raise AdapterLoadError(
                f"unexpected tensor {key!r}: only lora_A / lora_B weights of decoder layers, embed_tokens and lm_head"
            )
        layer, hf_module, which = parsed
        module = _shared_or_plain(key, hf_module, model_config)
        shapes = full_shapes(model_config, layer if layer < model_config.num_layers else None)
        if hf_module not in LAYER_MODULES or module not in shapes:
            raise AdapterLoadError(f"tensor {key!r}: unknown target module {module!r}")
        if hf_module not in config.target_modules:
            raise AdapterLoadError(f"tensor {key!r} is for {hf_module!r}, which target_modules does not list")
        if not layer < model_config.num_layers:
            raise AdapterLoadError(
                f"tensor {key!r}: layer {layer} is out of range (the base model has {model_config.num_layers} layers)"
            )
        if is_expert_module(model_config, layer, module):
            raise AdapterLoadError(f"tensor {key!r}: layer {layer}'s MLP is a mixture of experts; no expert is named")
        if not layer_has_module(model_config, layer, module):
            raise AdapterLoadError(f"tensor {key!r}: layer {layer} of the base model has no {module}")
        r, alpha = config.parsed.module_rank_alpha(_module_name(fused_keys.get(key, key)))
        in_features, out_features = shapes[module]
        expected = (r, in_features) if which == "A" else (out_features, r)
        if shape != expected:
            raise AdapterLoadError(
                f"shape mismatch with the base model: tensor {key!r} has shape {shape}, "
                f"expected {expected} (r={r}, {module} is {in_features} -> {out_features})"
            )
        if (layer, module, which) in found:
            raise AdapterLoadError(f"tensor {key!r}: layer {layer} {module} lora_{which} appears twice")
        found[(layer, module, which)] = key
        ranks[(layer, module)] = (r, alpha)
    pairs = {}
    for layer, module, which in found:
        if which == "A":
            if (layer, module, "B") not in found:
                raise AdapterLoadError(f"missing lora_B weight for layers.{layer}.{module}")
            r, alpha = ranks[(layer, module)]
            scale = config.parsed.module_scale(r, alpha)
            pairs[(layer, module)] = (found[(layer, module, "A")], found[(layer, module, "B")], scale)
        elif (layer, module, "A") not in found:
            raise AdapterLoadError(f"missing lora_A weight for layers.{layer}.{module}")
    return pairs


# DoRA is served on the linears LoRALinear wraps; these have wrappers of their own
_NO_DORA = (*MODEL_TARGETS, "kv_b_proj")


def _match_magnitudes(
    magnitudes: dict[str, torch.Tensor],
    pairs: set[tuple[int, str]],
    config: _Config,
    model_config: ModelConfig,
    tp_rank: int,
    tp_size: int,
    expert_pairs: dict,
) -> DoraNorms | None:
    """DoRA's magnitude vectors, one per (layer, module) that has A and B, each (out,) (a fused module's split into
    its slices'), as this rank keeps it: a column-parallel module's rows of this rank, a row-parallel one's all."""
    if not config.parsed.use_dora:
        if magnitudes:
            raise AdapterLoadError(f"tensor {next(iter(magnitudes))!r} is a DoRA magnitude, but use_dora is false")
        return None
    check_dora_targets(config.target_modules, _NO_DORA)
    if expert_pairs:
        raise AdapterLoadError("DoRA (use_dora: true) on MoE experts is not supported")
    shapes = full_shapes(model_config)
    found: dict[tuple[int, str], torch.Tensor] = {}
    for key, magnitude in magnitudes.items():
        parsed = parse_lora_key(lora_key_of(key, "B"))
        if parsed is None:
            raise AdapterLoadError(f"unexpected tensor {key!r}: a DoRA magnitude of no decoder layer's linear")
        layer, hf_module, _ = parsed
        slices = FUSED_TARGETS.get(hf_module, (hf_module,))
        sizes = [shapes[module][1] for module in slices if module in shapes]
        if magnitude.dim() != 1 or len(sizes) != len(slices) or magnitude.shape[0] != sum(sizes):
            raise AdapterLoadError(
                f"shape mismatch with the base model: tensor {key!r} has shape {tuple(magnitude.shape)}, "
                f"expected ({sum(sizes)},) ({hf_module}'s outputs)"
            )
        if hf_module in GROUPED_TARGETS:
            raise AdapterLoadError(f"DoRA on {hf_module} (grouped projections) is not supported")
        for module, part in zip(slices, magnitude.split(sizes), strict=True):
            slice_key = lora_key_of(key.replace(f".{hf_module}.", f".{module}."), "B")
            module = _shared_or_plain(slice_key, module, model_config)
            if (layer, module) not in pairs:
                raise AdapterLoadError(f"tensor {key!r}: a DoRA magnitude of a module without lora_A / lora_B")
            if (layer, module) in found:
                raise AdapterLoadError(f"tensor {key!r}: layers.{layer}.{module}'s magnitude appears twice")
            found[(layer, module)] = _keep(slice_key, part[:, None], tp_rank, tp_size)[:, 0].clone()
    missing = sorted(pairs - set(found))
    if missing:
        layer, module = missing[0]
        raise AdapterLoadError(f"missing lora_magnitude_vector for layers.{layer}.{module} (use_dora is true)")
    row_parallel = frozenset(key for key in found if TP_MODES.get(key[1].removeprefix(SHARED_PREFIX)) == "row")
    return DoraNorms(magnitudes=found, row_parallel=row_parallel if tp_size > 1 else frozenset())


def _split_fused(
    tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], model_config: ModelConfig
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]], dict[str, str]]:
    """Each lora_A / lora_B of a fused module (lora_targets.FUSED_TARGETS) as its slices' (the same A; B's rows of
    the slice), under the slice's name. Returns the tensors, their whole shapes, and the keys made here, each with
    the fused tensor's key: whole tensors, for a fused module's travel uncut (protocol/adapters/lora_shards.py), and the
    name a rank_pattern / alpha_pattern matches (PEFT's module is the fused one)."""
    out_features = {module: out for module, (_, out) in full_shapes(model_config).items()}
    split_tensors: dict[str, torch.Tensor] = {}
    split_shapes: dict[str, tuple[int, ...]] = {}
    made: dict[str, str] = {}
    for key, tensor in tensors.items():
        parsed = parse_lora_key(key)
        if parsed is None or parsed[1] not in FUSED_TARGETS:
            split_tensors[key], split_shapes[key] = tensor, shapes[key]
            continue
        _, fused, which = parsed
        slices = FUSED_TARGETS[fused]
        sizes = [out_features[module] for module in slices]
        if which == "B" and (len(shapes[key]) != 2 or shapes[key][0] != sum(sizes)):
            raise AdapterLoadError(
                f"shape mismatch with the base model: tensor {key!r} has shape {shapes[key]}, expected "
                f"({sum(sizes)}, r) ({fused} fuses {'+'.join(slices)}: {'+'.join(map(str, sizes))} outputs)"
            )
        parts = slice_order_rows(model_config, fused, tensor).split(sizes, dim=0) if which == "B" else \
            [tensor] * len(slices)  # fmt: skip
        for module, part in zip(slices, parts, strict=True):
            slice_key = key.replace(f".{fused}.", f".{module}.")
            if slice_key in tensors:
                raise AdapterLoadError(f"tensor {key!r}: {module} lora_{which} also appears as {slice_key!r}")
            split_tensors[slice_key], split_shapes[slice_key] = part, tuple(part.shape)
            made[slice_key] = key
    return split_tensors, split_shapes, made


def _shared_or_plain(key: str, hf_module: str, model_config: ModelConfig) -> str:
    """A shared expert's MLP module (DeepSeek-V3's `shared_experts.`; Llama 4's, Qwen3-Next's and Qwen3.5-MoE's
    `shared_expert.`; Gemma 4's dense MLP beside its experts, `mlp.`), keyed apart from the routed experts' of its
    layer as `shared_experts.` + module; any other its own name. A shared expert named otherwise than this model
    names its own is refused."""
    name = model_config.moe.shared_expert_name if model_config.moe is not None else None
    if name is not None and f".{name}.{hf_module}." in key:
        return SHARED_PREFIX + hf_module
    if any(f".{other}.{hf_module}." in key for other in ("shared_experts", "shared_expert")):
        raise AdapterLoadError(f"tensor {key!r}: LoRA on this model's shared expert is not supported")
    return hf_module


def _fold_scale(lora_b: torch.Tensor, module_scale: float, config: _Config) -> torch.Tensor:
    """B with its module's scale over the adapter's folded in: the pool holds one scale per slot."""
    if module_scale == config.parsed.scale:
        return lora_b
    return lora_b * (module_scale / config.parsed.scale)


def _module_name(key: str) -> str:
    """The module's name as PEFT matches rank/alpha patterns against it: model.layers.0.self_attn.q_proj."""
    return re.sub(r"\.lora_[AB](\.\w+)?\.weight$", "", key).removeprefix("base_model.model.")


def _check_complete(pairs: set[tuple[int, str]], config: _Config, model_config: ModelConfig) -> None:
    """Every target in every layer the config names has weights; but in an MoE model a dense layer's MLP may go
    without (PEFT converts a per-expert adapter to the stacked experts, where it no longer reaches them), and where a
    layer has a shared expert, its weights or the routed experts' will do (PEFT's target_modules reach the one, its
    target_parameters the other)."""
    for layer in config.layers:
        for module in config.target_modules:
            if module in MODEL_TARGETS or not layer_has_module(model_config, layer, module):
                continue  # not a layer's (_match_vocab_tensors), or not this layer's kind (a hybrid model's)
            expert = is_expert_module(model_config, layer, module)
            optional = model_config.moe is not None and module in MLP_MODULES and not expert
            if expert and (layer, SHARED_PREFIX + module) in pairs:
                continue
            if (layer, module) not in pairs and not optional:
                name = f"experts.{module}" if expert else module
                raise AdapterLoadError(f"missing lora_A weight for layers.{layer}.{name}")


def _keep(key: str, tensor: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of a whole A or B (a view)."""
    cut = rank_cut(key, tensor.shape, tp_rank, tp_size)
    return tensor if cut is None else tensor.narrow(*cut)


def _keep_experts(
    module: str, lora_a: torch.Tensor, lora_b: torch.Tensor, tp_rank: int, tp_size: int, expert_parallel: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slices of stacked expert A (experts, r, in) and B (experts, out, r): each expert is cut as the
    dense module is (column: B's rows; row: A's columns); under expert parallelism, this rank's experts whole."""
    if tp_size == 1:
        return lora_a, lora_b
    if expert_parallel:
        num_local = lora_a.shape[0] // tp_size
        return lora_a.narrow(0, tp_rank * num_local, num_local), lora_b.narrow(0, tp_rank * num_local, num_local)
    if TP_MODES[module] == "column":
        rows = lora_b.shape[1] // tp_size
        return lora_a, lora_b.narrow(1, tp_rank * rows, rows)
    cols = lora_a.shape[2] // tp_size
    return lora_a.narrow(2, tp_rank * cols, cols), lora_b


def _host_copy(t: torch.Tensor, pin: bool, tp_size: int, transposed: bool = False) -> torch.Tensor:
    if pin:
        if transposed:  # B (out, r) laid out as Bᵀ (r, out), as the pool holds it: its upload is one pinned source
            return t.mT.contiguous().pin_memory().mT  # a copy
        return t.contiguous().pin_memory()  # a copy
    # Under TP, a copy of each shard, so that the buffer holding the whole adapter is freed; at TP=1 the views of
    # that buffer are the host copy.
    return t.clone(memory_format=torch.contiguous_format) if tp_size > 1 else t
