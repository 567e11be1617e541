"""LoRAManager: this rank's adapters. Host copies by lora_id, the device pool and which lora_id sits in each slot
(as the scheduler says), and the token segments of each forward.

Loading is split so the disk read runs off the decode loop: `read` (any thread; touches no state here), then
`install` (the loader's thread) keeps the host copy under a new lora_id, which no forward pass refers to yet. `drop`
(the main loop) may come first, when a load times out on this rank: the id is then remembered, and a late `install`
of it keeps nothing. `load` does both steps, for tests and in-process use."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Sequence

import torch
from loraplex.kernels import LoRABackend, LoRABatchMeta
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import AdapterOutcome, AdapterToLoad, ForwardReq, SlotLoad, split_inline_frames
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.lora.adapter import AdapterLoadError, LoRAAdapter, PoolSpec, adapter_from_tensors, load_adapter
from loraplex.worker.lora.copies import (
    CopyEmbedding,
    CopyLMHead,
    ModuleCopies,
    check_head_copies,
    wrap_head_linears,
)
from loraplex.worker.lora.dora import base_rows_sq, reduce_norms, weight_norm_sq
from loraplex.worker.lora.experts import LoRAExpertsLinear
from loraplex.worker.lora.latent import LoRALatentKVProj
from loraplex.worker.lora.layers import LoRABatchInfo, LoRALinear
from loraplex.worker.lora.pool import LoRABuffers, LoRAPool
from loraplex.worker.lora.targets import EXPERT_FUSED_LINEARS, KINDS_OF, full_shapes
from loraplex.worker.lora.tower import TowerLoRA, tower_root
from loraplex.worker.lora.upload import uploader_for
from loraplex.worker.lora.vocab import EMBED, HEAD, LoRAEmbedding, LoRALMHead
from loraplex.worker.model.config import ModelConfig
from torch import nn

logger = logging.getLogger(__name__)

# The linears whose model code calls more than forward (fused name -> wrapper); the others get LoRALinear.
WRAPPERS = {"self_attn.kv_b_proj": LoRALatentKVProj}


class LoRAConfigError(ValueError):
    pass


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        config: ServerConfig,
        tp_rank: int,
        tp_size: int,
        device: torch.device,
        dtype: torch.dtype,
        backend: LoRABackend,
    ):
        """Build the pool for the model (its decoder layers, embed_tokens and lm_head) and wrap the targeted layers
        in place."""
        if config.max_lora_rank is None or not config.target_modules:
            raise LoRAConfigError(
                "LoRA is enabled but --max-lora-rank and --lora-target-modules are not both set "
                "(the launcher infers them from --lora-paths)"
            )
        self.model_config = model_config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.spec = PoolSpec(
            max_lora_rank=config.max_lora_rank,
            # "all" names every layer linear of any family: the pool holds this model's
            target_modules=tuple(m for m in config.target_modules if m in full_shapes(model_config)),
            dtype=dtype,
            device=torch.device(device),
            expert_parallel=config.enable_expert_parallel,
            tower=model_config.vision if config.enable_tower_connector_lora else None,
        )
        layers = model.model.layers
        vocab_shapes = {EMBED: (model_config.vocab_size, model_config.hidden_size),
                        HEAD: (model_config.hidden_size, model_config.vocab_size)}  # fmt: skip
        self.pool = LoRAPool(layers, self.spec, config.max_loras_per_batch, vocab_shapes)
        self.uploader = uploader_for(self.spec.device)  # every pool write goes through it (a side stream on CUDA)
        self.batch = LoRABatchInfo(backend=backend)
        self.base_linears: dict[tuple[int, str], nn.Module] = {}  # (layer, fused name) -> the wrapped linear
        # (layer, fused name) -> Σ W² per output row of this rank (float32): DoRA's norms start from it; read at
        # start-up where the weights are packed next (read_base_norms), else at the first DoRA adapter on the linear
        # (the loader's thread); kept for the next
        self._base_rows_sq: dict[tuple[int, str], torch.Tensor] = {}
        for (layer_id, name), buffers in self.pool.buffers.items():
            parent_name, attr = name.rsplit(".", 1)
            parent = layers[layer_id].get_submodule(parent_name)
            self.base_linears[(layer_id, name)] = getattr(parent, attr)
            wrapper = LoRAExpertsLinear if buffers.fused in EXPERT_FUSED_LINEARS else WRAPPERS.get(name, LoRALinear)
            setattr(parent, attr, wrapper(getattr(parent, attr), buffers, self.batch))
        # Full copies and token patches replace their slots' rows of the base layers' output; the vocab LoRA wrappers
        # around them add to other slots' rows only (an adapter never has both on one layer).
        self.copies = ModuleCopies(config.max_full_module_copies, self.pool.num_slots, self.spec.device,
                                   model_config.tie_word_embeddings)  # fmt: skip
        model.model.embed_tokens = CopyEmbedding(model.model.embed_tokens, self.copies, self.batch)
        if hasattr(model, "lm_head"):  # a pooling model's embedder or classifier has none
            model.lm_head = CopyLMHead(model.lm_head, self.copies, self.batch)
        # a pooling classifier's head (worker/pooling.py): adapters may carry their own (modules_to_save)
        self.head_linears = wrap_head_linears(model, self.copies, self.batch)
        if EMBED in self.pool.vocab:
            model.model.embed_tokens = LoRAEmbedding(model.model.embed_tokens, self.pool.vocab[EMBED], self.batch)
        if HEAD in self.pool.vocab and hasattr(model, "lm_head"):
            model.lm_head = LoRALMHead(model.lm_head, self.pool.vocab[HEAD], self.batch)
        # --enable-tower-connector-lora: the vision tower's linears wrapped, each image encoded with its adapter
        tower = self.spec.tower
        self.tower = TowerLoRA(tower_root(model, tower), tower) if tower is not None else None
        self.adapters: dict[int, LoRAAdapter] = {}  # lora_id -> host copy
        self.names: dict[int, str] = {}  # lora_id -> the name it was loaded under (draft adapters go by it)
        self._dropped_early: set[int] = set()  # ids dropped before their install (ids are never reused)
        self._lock = threading.Lock()  # adapters and _dropped_early: install runs on the loader's thread
        self.slot_lora_ids = [-1] * self.pool.num_slots  # -1 = empty
        logger.info(
            "LoRA pool: %d slots, max rank %d, targets %s, %.1f MiB",
            self.pool.num_slots,
            self.spec.max_lora_rank,
            ",".join(self.spec.target_modules),
            self.pool.num_bytes / 2**20,
        )

    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    @property
    def backend(self) -> LoRABackend:
        return self.batch.backend

    def warmup(self) -> None:
        """Compile the backend's kernels for every shape this pool can meet (Triton; nothing on the CPU), logged."""
        weights = {}  # one linear of each kind: every layer's are the same shapes
        for (_, name), buffers in self.pool.buffers.items():
            weights.setdefault(name, buffers)
        start = time.perf_counter()
        # The scheduler sorts a batch by slot: at most one segment per slot, and one of base rows. An MoE layer's rows
        # regroup by expert (worker/lora/experts.py): at most that many runs within each expert.
        by_segments: dict[int, list[LoRABuffers]] = {}
        for buffers in weights.values():
            by_segments.setdefault(buffers.num_experts * (self.num_slots + 1), []).append(buffers)
        launches = sum(
            self.backend.warmup(group, max_segments=max_segments, show_progress=self.tp_rank == 0)
            for max_segments, group in sorted(by_segments.items())
        )
        if launches:
            logger.info(
                "LoRA %s kernels compiled for %d linear shapes and up to %d segments: %d launches in %.1f s",
                self.backend.name, len(weights), max(by_segments), launches, time.perf_counter() - start,
            )  # fmt: skip

    # ---- adapters (host copies) ---------------------------------------------------------------------

    def read(
        self, specs: Sequence[AdapterToLoad], frames: Sequence = (), is_cut: bool = False
    ) -> list[LoRAAdapter | AdapterLoadError]:
        """Read, validate and slice each adapter; safe on any thread. Never raises: a failure is an outcome.
        `frames`: the inline adapters' tensor bytes (LoadAdapters' extra frames); `is_cut`: already only this
        rank's part of each tensor (LoadAdapters.frames_per_rank)."""
        try:
            buffers = split_inline_frames(list(specs), list(frames))
        except ValueError as e:
            return [AdapterLoadError(f"malformed load: {e}", "internal") for _ in specs]
        outcomes: list[LoRAAdapter | AdapterLoadError] = []
        for spec, spec_buffers in zip(specs, buffers, strict=True):
            try:
                if spec.inline is not None:
                    adapter = adapter_from_tensors(
                        spec.inline.config,
                        spec.inline.tensors,
                        spec_buffers,
                        spec.lora_id,
                        self.model_config,
                        self.spec,
                        self.tp_rank,
                        self.tp_size,
                        is_cut=is_cut,
                    )
                else:
                    adapter = load_adapter(
                        spec.lora_path,
                        spec.lora_id,
                        self.model_config,
                        self.spec,
                        self.tp_rank,
                        self.tp_size,
                        lora_name=spec.lora_name,
                        path_root=spec.root,  # every file read is checked against it, reloads too
                    )
                if adapter.dora is not None:
                    self._dora_norms(adapter)
                outcomes.append(adapter)
            except AdapterLoadError as e:
                outcomes.append(e)
            except Exception as e:  # an unforeseen failure still fails only this adapter
                logger.exception("reading adapter %r from %s failed", spec.lora_name, spec.lora_path or "tensors")
                outcomes.append(AdapterLoadError(f"{type(e).__name__}: {e}", "internal"))
        return outcomes

    def read_base_norms(self) -> None:
        """Read each wrapped linear's Σ W² per row now, while its weight is plain (one pass over the weights): the
        model runner packs them next, and a packed weight gives them only through an identity pass per linear."""
        for key, linear in self.base_linears.items():
            weight = getattr(linear, "weight", None)
            if getattr(linear, "quant", None) is None and weight is not None and weight.dim() == 2:
                self._base_rows_sq[key] = base_rows_sq(linear)

    def _dora_norms(self, adapter: LoRAAdapter) -> None:
        """This rank's part of each DoRA module's ‖W + scale·B·A‖² per output row (worker/lora/dora.py)."""
        for key in adapter.dora.magnitudes:
            buffers, slice_id = self.pool.slice_of[key]
            rows = slice(buffers.row_offsets[slice_id], buffers.row_offsets[slice_id + 1])
            lora_a, lora_b = adapter.weights[key]
            linear_key = (key[0], buffers.fused.name)
            linear = self.base_linears[linear_key]
            if linear_key not in self._base_rows_sq:
                self._base_rows_sq[linear_key] = base_rows_sq(linear)
            base_sq = self._base_rows_sq[linear_key][rows]
            adapter.dora.norms_sq[key] = weight_norm_sq(linear, rows, lora_a, lora_b, adapter.scale, base_sq).cpu()

    def install(
        self, specs: Sequence[AdapterToLoad], outcomes: Sequence[LoRAAdapter | AdapterLoadError]
    ) -> list[AdapterOutcome]:
        """Keep the host copies that `read` produced; one outcome per adapter."""
        results = []
        for spec, outcome in zip(specs, outcomes, strict=True):
            with self._lock:
                if spec.lora_id in self._dropped_early:
                    self._dropped_early.discard(spec.lora_id)
                    outcome = AdapterLoadError(f"lora_id {spec.lora_id} was dropped while it loaded", "internal")
                elif isinstance(outcome, LoRAAdapter) and spec.lora_id in self.adapters:
                    outcome = AdapterLoadError(f"lora_id {spec.lora_id} is already loaded on this rank", "internal")
                elif isinstance(outcome, LoRAAdapter):
                    try:
                        check_head_copies(outcome, self.head_linears)
                        self.copies.reserve(outcome)
                        self.adapters[spec.lora_id] = outcome
                        self.names[spec.lora_id] = spec.lora_name
                    except AdapterLoadError as e:
                        outcome = e
            if isinstance(outcome, AdapterLoadError):
                logger.warning("adapter %r (%s) refused: %s", spec.lora_name, spec.lora_path or "tensors", outcome)
                results.append(
                    AdapterOutcome(
                        lora_id=spec.lora_id, success=False, error_message=str(outcome), error_kind=outcome.kind
                    )
                )
                continue
            logger.info(
                "adapter %r (id %d) loaded: r=%d, scale %g, %s, %.1f MiB on this rank",
                spec.lora_name,
                spec.lora_id,
                outcome.lora_rank,
                outcome.scale,
                ",".join(outcome.target_modules),
                outcome.num_bytes / 2**20,
            )
            results.append(
                AdapterOutcome(
                    lora_id=spec.lora_id,
                    success=True,
                    lora_rank=outcome.lora_rank,
                    target_modules=list(outcome.target_modules),
                    dora=outcome.dora is not None,
                )
            )
        return results

    def load(self, specs: Sequence[AdapterToLoad], frames: Sequence = ()) -> list[AdapterOutcome]:
        return self.install(specs, self.read(specs, frames))

    def drop(self, lora_ids: Sequence[int]) -> None:
        """Forget these adapters and empty any slot that holds one; an id not installed yet never will be."""
        with self._lock:
            for lora_id in lora_ids:
                if self.adapters.pop(lora_id, None) is None:
                    self._dropped_early.add(lora_id)
                self.names.pop(lora_id, None)
                self.copies.release(lora_id)
        for slot, lora_id in enumerate(self.slot_lora_ids):
            if lora_id in lora_ids:
                with self.uploader.upload():
                    self.pool.clear_slot(slot)
                self.copies.clear_slot(slot)
                self.slot_lora_ids[slot] = -1

    def tower_weights(self, slot: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The vision tower's weights of the adapter in `slot` ({} for none, or the base's -1)."""
        lora_id = self.slot_lora_ids[slot] if slot != -1 else -1
        return self.adapters[lora_id].tower_weights if lora_id != -1 else {}

    # ---- slots and batches -------------------------------------------------------------------------

    def slot_adapter_name(self, slot: int) -> str | None:
        """The name of the adapter in `slot` (as the last slot loads left it); None for -1 or an empty slot."""
        lora_id = self.slot_lora_ids[slot] if 0 <= slot < self.num_slots else -1
        return self.names.get(lora_id)

    def apply_slot_loads(self, slot_loads: Sequence[SlotLoad]) -> None:
        """Copy each named adapter into its slot (lora_id -1 empties it). All or nothing: checked before any copy."""
        for load in slot_loads:
            if not 0 <= load.slot < self.num_slots:
                raise BatchError(f"slot load into slot {load.slot}, outside 0..{self.num_slots - 1}")
            if load.lora_id != -1 and load.lora_id not in self.adapters:
                raise BatchError(
                    f"slot load of adapter id {load.lora_id} into slot {load.slot}: "
                    f"the adapter is not loaded on rank {self.tp_rank} (dropped or never loaded)"
                )
        for load in slot_loads:  # the same slot loads in the same order on every rank: a collective is safe here
            dora = self.adapters[load.lora_id].dora if load.lora_id != -1 else None
            if dora is not None:
                reduce_norms(dora, self.tp_size, self.spec.device)
        with self.uploader.upload():
            for load in slot_loads:
                if load.lora_id == -1:
                    self.pool.clear_slot(load.slot)
                    self.copies.clear_slot(load.slot)
                elif self.slot_lora_ids[load.slot] != load.lora_id:  # host copies never change under one id
                    self.pool.load_slot(load.slot, self.adapters[load.lora_id])
                    self.copies.load_slot(load.slot, self.adapters[load.lora_id])
                self.slot_lora_ids[load.slot] = load.lora_id

    def prepare(self, reqs: Sequence[ForwardReq]) -> None:
        """Group the batch's tokens (request order) into segments of consecutive requests with one slot."""
        seg_indptr, seg_slots = self._segments(reqs)
        used = sorted({slot for slot in seg_slots if slot != -1})
        self.batch.used_slots = tuple(used)
        if not used:
            self.batch.meta = None
            self.batch.active = self.batch.dora_active = frozenset()
            self.batch.token_slots = self.batch.row_slots = None  # none of another batch's
            self.batch.token_scales = self.batch.row_scales = self.batch.host_row_scales = None
            return
        row_scales = None  # (tokens,) each row's request strength; None: all 1
        if any(req.lora_scale != 1.0 for req in reqs):
            row_scales = [req.lora_scale for req in reqs for _ in range(len(req.input_ids))]
        self.batch.meta = self.batch.backend.prepare(seg_indptr, seg_slots, row_scales)
        self.batch.host_segments = (seg_indptr, seg_slots)
        self.batch.host_row_scales = row_scales
        self.batch.active = self._targeted(used) | self._targeted_vocab(used)
        has_copies = self.copies.holds_any(used)
        if self.pool.vocab or has_copies or self.pool.dora_slots.intersection(used):
            lengths = torch.tensor([len(req.input_ids) for req in reqs])
            slots = torch.tensor([req.slot for req in reqs]).repeat_interleave(lengths)  # (tokens,)
            slots = slots.to(self.spec.device, non_blocking=True)
        if self.pool.vocab or has_copies:
            self.batch.token_slots = self.batch.row_slots = slots
            self.batch.token_scales = self.batch.row_scales = self.batch.meta.row_scales
        else:  # none of another batch's
            self.batch.token_slots = self.batch.row_slots = None
            self.batch.token_scales = self.batch.row_scales = None
        self.batch.dora_active = self._targeted(self.pool.dora_slots.intersection(used))
        self.batch.dora_rows = torch.where(slots < 0, self.num_slots, slots) if self.batch.dora_active else None

    def _targeted(self, slots: Iterable[int]) -> frozenset[str]:
        """The fused linears that the adapters in `slots` target."""
        modules = {module for slot in slots for module in self.adapters[self.slot_lora_ids[slot]].target_modules}
        return frozenset(name for module in modules for name in KINDS_OF.get(module, ()))

    def _targeted_vocab(self, slots: Iterable[int]) -> frozenset[str]:
        """embed_tokens and lm_head where an adapter in `slots` targets them (named by their module)."""
        return frozenset(m for slot in slots for m in self.adapters[self.slot_lora_ids[slot]].target_modules
                         if m not in KINDS_OF)  # fmt: skip

    def select_rows(self, rows: torch.Tensor) -> None:
        """The LM head computes these token rows (rows,) of this forward (default: every token)."""
        if self.batch.token_slots is not None:
            self.batch.row_slots = self.batch.token_slots[rows]
        if self.batch.token_scales is not None:
            self.batch.row_scales = self.batch.token_scales[rows]

    def uses_dora(self, reqs: Sequence[ForwardReq]) -> bool:
        """Whether a request's slot holds a DoRA adapter, module copies or token rows (the decode graphs do not
        rescale rows or replace them: it runs eagerly)."""
        return any(req.slot in self.pool.dora_slots for req in reqs) or self.copies.holds_any(r.slot for r in reqs)

    def prepare_fixed(self, reqs: Sequence[ForwardReq], num_segments: int, into: LoRABatchMeta | None) -> LoRABatchMeta:
        """prepare() in the fixed shapes a CUDA graph replays: the segments padded with empty ones to `num_segments`,
        every LoRA linear active (base rows cost a program that exits), and the metadata written into `into`'s
        tensors, those the graph was captured with (None: at capture, the new metadata is kept as they)."""
        seg_indptr, seg_slots = self._segments(reqs)
        if len(seg_slots) > num_segments:
            raise BatchError(f"{len(seg_slots)} segments exceed the {num_segments} of the captured shape")
        padding = num_segments - len(seg_slots)
        meta = self.batch.backend.prepare(seg_indptr + [seg_indptr[-1]] * padding, seg_slots + [-1] * padding)
        if into is not None:
            for f in dataclasses.fields(meta):
                new, old = getattr(meta, f.name), getattr(into, f.name)
                if isinstance(new, torch.Tensor):
                    old.copy_(new)
                elif new != old:  # the plan depends on the shapes alone, so this is a bug
                    raise RuntimeError(f"LoRA metadata {f.name} {new!r} differs from the captured {old!r}")
            meta = into
        self.batch.meta = meta
        self.batch.host_segments = (seg_indptr, seg_slots)
        self.batch.host_row_scales = None  # a replayed batch's scales are all 1 (DecodeGraphRunner.can_run)
        self.batch.active = frozenset(buffers.fused.name for buffers in self.pool.buffers.values())
        self.batch.dora_active = frozenset()  # batches with DoRA rows run eagerly (uses_dora)
        self.batch.used_slots = ()  # and so do those with module copies or token rows: a graph holds none of their ops
        return meta

    def _segments(self, reqs: Sequence[ForwardReq]) -> tuple[list[int], list[int]]:
        self.uploader.ready()  # the slots this pass reads are uploaded (a wait queued on the compute stream, on CUDA)
        seg_indptr, seg_slots = [0], []
        for i, req in enumerate(reqs):
            if req.slot != -1 and not (0 <= req.slot < self.num_slots and self.slot_lora_ids[req.slot] != -1):
                raise BatchError(f"request {i} uses slot {req.slot}, which holds no adapter")
            if seg_slots and seg_slots[-1] == req.slot:
                seg_indptr[-1] += len(req.input_ids)
            else:
                seg_slots.append(req.slot)
                seg_indptr.append(seg_indptr[-1] + len(req.input_ids))
        return seg_indptr, seg_slots
