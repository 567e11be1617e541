"""LoRA on a vision-language model's vision tower and patch merger (--enable-tower-connector-lora): each image is
encoded with its request's adapter. Qwen-VL's tower as below; Gemma 3's SigLIP (`vision_tower.*`): each block's
q/k/v_proj and fc1 (column parallel), out_proj and fc2 (row parallel), every patch of an image its adapter's rows.

An adapter's tower tensors (PEFT keys `...visual.<module>.lora_A/B.weight`: blocks.N.attn.qkv / attn.proj /
mlp.gate_proj / up_proj / down_proj, merger.mlp.0 / mlp.2; Qwen3-VL's blocks.N.mlp.linear_fc1 / linear_fc2 and its
mergers' and deepstack mergers' linear_fc1 / linear_fc2) are kept per module of ours as one (A, B) pair of this
rank: the slices of a fused linear (gate_up_proj's gate and up) stacked along the rank, B block-diagonal, the scale
folded into B; column-parallel linears keep B's rows of this rank, row-parallel ones A's columns (their delta joins the
layer's partial sum before its one all-reduce). The tower's linears are wrapped once at start; a pass sets which rows
(each image's patches, or its merged rows in the merger) take which adapter, and every wrapper adds x·Aᵀ·Bᵀ to those
rows. The tower's images are few and short next to the decoder's tokens: a plain gather per adapter, no kernel.

Llama 4's vision model and projector (PEFT keys `...vision_model.<module>...` / `...multi_modal_projector.linear_1...`:
its encoder layers' self_attn.q/k/v/o_proj and mlp.fc1/fc2, vision_adapter.mlp.fc1/fc2, the projector's linear_1,
which is whole on every rank) are named from the model itself; every one of its linears reads rows of (tiles, ...)
whose first dimension is the tile, one image of worker/images.py, so an adapter's rows are its tiles'.

Gemma 4's tower and embedder (PEFT keys `...vision_tower.encoder.layers.N.self_attn.q_proj.linear` ..., the `linear`
inside each clippable projection, and `...embed_vision.embedding_projection`, whole on every rank) are named from the
model too; the embedder reads soft tokens, the merged rows."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from loraplex.protocol.adapters.adapter_config import AdapterLoadError
from loraplex.worker.model.config import Gemma4VisionConfig, Llama4VisionConfig, SiglipVisionConfig, VisionConfig
from torch import nn

# the tower's root in PEFT's key: Qwen-VL's `visual.`, Gemma 3's SigLIP `vision_tower.` (the Hub's transformers 4
# checkpoints: `vision_tower.vision_model.`), Gemma 4's `vision_tower.` and `embed_vision.`, Llama 4's
# `vision_model.` / `multi_modal_projector.`
TOWER_KEY = re.compile(r"(?:^|\.)((?:visual|vision_tower|vision_model|multi_modal_projector|embed_vision)\..+)"
                       r"\.lora_([AB])(?:\.\w+)?\.weight$")
TOWER_FLAG = "--enable-tower-connector-lora"
# PEFT's slices of our fused linears -> (our fused module, slice)
_SLICES = {"mlp.gate_proj": ("mlp.gate_up_proj", 0), "mlp.up_proj": ("mlp.gate_up_proj", 1),
           "self_attn.q_proj": ("self_attn.qkv_proj", 0), "self_attn.k_proj": ("self_attn.qkv_proj", 1),
           "self_attn.v_proj": ("self_attn.qkv_proj", 2)}  # fmt: skip


def is_tower_key(key: str) -> bool:
    return TOWER_KEY.search(key) is not None


@dataclass(frozen=True)
class TowerLinear:
    mode: str  # "column", "row" or "replicated"
    input_size: int
    output_sizes: tuple[int, ...]  # per fused slice (qkv's three, gate_up's two)


def tower_root(model: nn.Module, c: VisionConfig | Llama4VisionConfig | SiglipVisionConfig) -> nn.Module:
    """The module tower_linears' paths start from: Qwen-VL's tower, Gemma 3's SigLIP, Llama 4's and Gemma 4's whole
    model."""
    if isinstance(c, SiglipVisionConfig):
        return model.vision_tower
    return model if _from_model(c) else model.visual


def _from_model(c: VisionConfig | Llama4VisionConfig | SiglipVisionConfig) -> bool:
    return isinstance(c, (Llama4VisionConfig, Gemma4VisionConfig))


def tower_linears(c: VisionConfig | Llama4VisionConfig | SiglipVisionConfig) -> dict[str, TowerLinear]:
    """Our module path inside the tower -> its shape, for every linear an adapter may reach."""
    if isinstance(c, Llama4VisionConfig):
        return _llama4_linears(c)
    if isinstance(c, Gemma4VisionConfig):  # before Qwen-VL's: a VisionConfig too
        return _gemma4_linears(c)
    if isinstance(c, SiglipVisionConfig):  # Gemma 3's SigLIP (its projector is a bare matrix: no adapter's)
        return siglip_linears(c)
    group = c.hidden_size * c.spatial_merge_size**2
    out: dict[str, TowerLinear] = {}
    if c.kind == "qwen3_vl":  # its MLPs and mergers' linears are linear_fc1/2, as PEFT names them
        for i in range(c.depth):
            out[f"blocks.{i}.attn.qkv"] = TowerLinear("column", c.hidden_size, (c.hidden_size,) * 3)
            out[f"blocks.{i}.attn.proj"] = TowerLinear("row", c.hidden_size, (c.hidden_size,))
            out[f"blocks.{i}.mlp.linear_fc1"] = TowerLinear("column", c.hidden_size, (c.intermediate_size,))
            out[f"blocks.{i}.mlp.linear_fc2"] = TowerLinear("row", c.intermediate_size, (c.hidden_size,))
        for merger in ("merger", *(f"deepstack_merger_list.{j}" for j in range(len(c.deepstack_indexes)))):
            out[f"{merger}.linear_fc1"] = TowerLinear("column", group, (group,))
            out[f"{merger}.linear_fc2"] = TowerLinear("row", group, (c.out_hidden_size,))
        return out
    for i in range(c.depth):
        out[f"blocks.{i}.attn.qkv"] = TowerLinear("column", c.hidden_size, (c.hidden_size,) * 3)
        out[f"blocks.{i}.attn.proj"] = TowerLinear("row", c.hidden_size, (c.hidden_size,))
        out[f"blocks.{i}.mlp.gate_up_proj"] = TowerLinear("column", c.hidden_size, (c.intermediate_size,) * 2)
        out[f"blocks.{i}.mlp.down_proj"] = TowerLinear("row", c.intermediate_size, (c.hidden_size,))
    out["merger.mlp.0"] = TowerLinear("column", group, (group,))
    out["merger.mlp.2"] = TowerLinear("row", group, (c.out_hidden_size,))
    return out


def siglip_linears(c: SiglipVisionConfig) -> dict[str, TowerLinear]:
    out: dict[str, TowerLinear] = {}
    for i in range(c.depth):
        for name in ("q_proj", "k_proj", "v_proj"):
            out[f"encoder.layers.{i}.self_attn.{name}"] = TowerLinear("column", c.hidden_size, (c.hidden_size,))
        out[f"encoder.layers.{i}.self_attn.out_proj"] = TowerLinear("row", c.hidden_size, (c.hidden_size,))
        out[f"encoder.layers.{i}.mlp.fc1"] = TowerLinear("column", c.hidden_size, (c.intermediate_size,))
        out[f"encoder.layers.{i}.mlp.fc2"] = TowerLinear("row", c.intermediate_size, (c.hidden_size,))
    return out


def siglip_leaves(vision: object) -> set[str]:
    """The target_modules names of a SigLIP tower's linears (none for another tower: Qwen-VL's are TOWER_TARGETS)."""
    return {name.rpartition(".")[2] for name in siglip_linears(vision)} if isinstance(vision, SiglipVisionConfig) \
        else set()  # fmt: skip


def _llama4_linears(c: Llama4VisionConfig) -> dict[str, TowerLinear]:
    out: dict[str, TowerLinear] = {}
    for i in range(c.num_layers):
        layer = f"vision_model.model.layers.{i}"
        out[f"{layer}.self_attn.qkv_proj"] = TowerLinear("column", c.hidden_size, (c.hidden_size,) * 3)
        out[f"{layer}.self_attn.o_proj"] = TowerLinear("row", c.hidden_size, (c.hidden_size,))
        out[f"{layer}.mlp.fc1"] = TowerLinear("column", c.hidden_size, (c.intermediate_size,))
        out[f"{layer}.mlp.fc2"] = TowerLinear("row", c.intermediate_size, (c.hidden_size,))
    out["vision_model.vision_adapter.mlp.fc1"] = TowerLinear("column", c.intermediate_size, (c.projector_input_dim,))
    out["vision_model.vision_adapter.mlp.fc2"] = TowerLinear("row", c.projector_input_dim, (c.projector_output_dim,))
    out["multi_modal_projector.linear_1"] = TowerLinear("replicated", c.vision_output_dim, (c.out_hidden_size,))
    return out


def _gemma4_linears(c: Gemma4VisionConfig) -> dict[str, TowerLinear]:
    q_size, kv_size, hidden, mlp = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, \
        c.intermediate_size  # fmt: skip
    out: dict[str, TowerLinear] = {}
    for i in range(c.depth):
        layer = f"vision_tower.encoder.layers.{i}"
        for name, mode, size_in, size_out in (("self_attn.q_proj", "column", hidden, q_size),
                                              ("self_attn.k_proj", "column", hidden, kv_size),
                                              ("self_attn.v_proj", "column", hidden, kv_size),
                                              ("self_attn.o_proj", "row", q_size, hidden),
                                              ("mlp.gate_proj", "column", hidden, mlp),
                                              ("mlp.up_proj", "column", hidden, mlp),
                                              ("mlp.down_proj", "row", mlp, hidden)):  # fmt: skip
            out[f"{layer}.{name}.linear"] = TowerLinear(mode, size_in, (size_out,))
    out["embed_vision.embedding_projection"] = TowerLinear("replicated", hidden, (c.out_hidden_size,))
    return out


def _our_path(path: str, vision: VisionConfig | Llama4VisionConfig | SiglipVisionConfig) -> tuple[str, int | None]:
    """A PEFT module path (from the tower's root name on) -> (our module path, slice of a fused linear or None)."""
    if isinstance(vision, SiglipVisionConfig):  # its q/k/v_proj are not fused
        return path.removeprefix("vision_tower.").removeprefix("vision_model."), None
    if isinstance(vision, VisionConfig):
        path = path.removeprefix("visual.")
    for theirs, (ours, slice_id) in _SLICES.items():
        if path.endswith("." + theirs):
            return path[: -len(theirs)] + ours, slice_id
    return path, None


def _shown(ours: str, vision: VisionConfig | Llama4VisionConfig | SiglipVisionConfig) -> str:
    """Our module path as an error names it: Qwen-VL's under `visual.`, Gemma 3's under `vision_tower.`, Llama 4's
    and Gemma 4's from the model's root."""
    if isinstance(vision, SiglipVisionConfig):
        return f"vision_tower.{ours}"
    return ours if _from_model(vision) else f"visual.{ours}"


def tower_weights(
    tensors: dict[str, torch.Tensor],
    vision: VisionConfig | Llama4VisionConfig | None,
    scale_of: Callable[[str], tuple[int, float]],
    tp_rank: int,
    tp_size: int,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapter's tower tensors -> our module path -> (A (R, in of this rank), B (out of this rank, R)), scale in
    B. `scale_of(key)`: the module's (r, scale) as its adapter config sets them."""
    if vision is None:
        raise AdapterLoadError(f"tensor {next(iter(tensors))!r} targets a vision tower, which this model lacks")
    linears = tower_linears(vision)
    pieces: dict[tuple[str, int | None], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        match = TOWER_KEY.search(key)
        path = match[1]
        ours, slice_id = _our_path(path, vision)
        if ours not in linears:
            raise AdapterLoadError(f"tensor {key!r}: unknown vision tower module {path!r}")
        pieces.setdefault((ours, slice_id), {})[match[2]] = (key, tensor)
    out: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor]]] = {}
    for (ours, slice_id), pair in pieces.items():
        if set(pair) != {"A", "B"}:
            raise AdapterLoadError(f"missing lora_{'B' if 'A' in pair else 'A'} weight for {_shown(ours, vision)}")
        (key_a, a), (_, b) = pair["A"], pair["B"]
        linear = linears[ours]
        r, scale = scale_of(key_a)
        full_out = linear.output_sizes[slice_id] if slice_id is not None else sum(linear.output_sizes)
        if tuple(a.shape) != (r, linear.input_size) or tuple(b.shape) != (full_out, r):
            raise AdapterLoadError(f"shape mismatch with the vision tower: {_shown(ours, vision)} lora_A "
                                   f"{tuple(a.shape)}, lora_B {tuple(b.shape)}, expected ({r}, {linear.input_size}), "
                                   f"({full_out}, {r})")
        out.setdefault(ours, []).append((slice_id, a, b * scale))
    return {ours: _this_rank(linears[ours], parts, tp_rank, tp_size) for ours, parts in out.items()}


def _this_rank(linear: TowerLinear, parts: list[tuple[int | None, torch.Tensor, torch.Tensor]], rank: int, size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One (A, B) for the module: slices stacked along the rank, B block-diagonal over this rank's output rows."""
    if linear.mode == "replicated":  # one slice, whole on every rank
        (_, a, b), = parts
        return a.contiguous(), b.contiguous()
    if linear.mode == "row":  # one slice: A's columns of this rank, B whole
        (_, a, b), = parts
        cols = linear.input_size // size
        return a[:, rank * cols : (rank + 1) * cols].contiguous(), b.contiguous()
    per_rank = [n // size for n in linear.output_sizes]
    offsets = [sum(per_rank[:i]) for i in range(len(per_rank))]
    total_r = sum(a.shape[0] for _, a, _ in parts)
    big_b = torch.zeros(sum(per_rank), total_r, dtype=parts[0][2].dtype)
    r0 = 0
    for slice_id, a, b in parts:
        r = a.shape[0]
        slices = range(len(per_rank)) if slice_id is None else [slice_id]
        rows = b.split(list(linear.output_sizes)) if slice_id is None else [b]
        for s, rows_s in zip(slices, rows, strict=True):
            mine = rows_s[rank * per_rank[s] : (rank + 1) * per_rank[s]]
            big_b[offsets[s] : offsets[s] + per_rank[s], r0 : r0 + r] = mine
        r0 += r
    return torch.cat([a for _, a, _ in parts]).contiguous(), big_b


class TowerRows:
    """This pass's adapters in the tower: (patch rows, merged rows, {module: (A, B)}) per adapter; empty: none."""

    def __init__(self):
        self.groups: list[tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = []


class TowerLoRALinear(nn.Module):
    """A tower linear plus its adapters' deltas on their rows; the base layer's own forward where a pass has none."""

    def __init__(self, base: nn.Module, name: str, rows: TowerRows):
        super().__init__()
        self.base, self.name, self.rows = base, name, rows
        # reads merged rows, not patches
        self.merged = name.startswith(("merger.", "deepstack_merger_list.", "embed_vision."))
        self.output_sizes_per_rank = base.output_sizes_per_rank  # what the model reads of the layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = [g for g in self.rows.groups if self.name in g[2]]
        if not groups:
            return self.base(x)
        y = self.base.partial(x)  # row-parallel: before its all-reduce, which sums the deltas of every rank too
        for patch_rows, merged_rows, weights in groups:
            rows = merged_rows if self.merged else patch_rows
            a, b = weights[self.name]
            y = y.index_add(0, rows, (x[rows] @ a.t().to(x.dtype)) @ b.t().to(x.dtype))
        return self.base.finish(y)


class TowerLoRA:
    """The wrapped tower and the rows each adapter takes in this pass."""

    def __init__(self, tower: nn.Module, vision: VisionConfig | Llama4VisionConfig):
        self.rows = TowerRows()
        # patches a merged row takes; Llama 4: 1 (each image is one tile and has one "patch": its leading index)
        self.unit = vision.spatial_merge_size**2 if isinstance(vision, VisionConfig) else 1
        for name in tower_linears(vision):
            parent_name, _, attr = name.rpartition(".")
            parent = tower.get_submodule(parent_name)
            base = parent[int(attr)] if attr.isdigit() else getattr(parent, attr)
            wrapper = TowerLoRALinear(base, name, self.rows)
            if attr.isdigit():
                parent[int(attr)] = wrapper
            else:
                setattr(parent, attr, wrapper)

    def begin(self, patch_counts: list[int], adapters: list[dict[str, tuple[torch.Tensor, torch.Tensor]] | None],
              scales: list[float], device: torch.device) -> None:  # fmt: skip
        """Image i (patch_counts[i] patches, in order) takes adapters[i]'s tower weights (None or {}: none) at
        strength scales[i]."""
        by_adapter: dict[tuple[int, float], list[int]] = {}
        for i, weights in enumerate(adapters):
            if weights:
                by_adapter.setdefault((id(weights), scales[i]), []).append(i)
        starts = [sum(patch_counts[:i]) for i in range(len(patch_counts))]
        groups = []
        for (_, scale), images in by_adapter.items():
            patches = torch.cat([torch.arange(starts[i], starts[i] + patch_counts[i]) for i in images]).to(device)
            merged = torch.cat([torch.arange(starts[i] // self.unit, (starts[i] + patch_counts[i]) // self.unit)
                                for i in images]).to(device)  # fmt: skip
            weights = {name: (a.to(device), b.to(device) * scale) for name, (a, b) in adapters[images[0]].items()}
            groups.append((patches, merged, weights))
        self.rows.groups = groups

    def end(self) -> None:
        self.rows.groups = []
