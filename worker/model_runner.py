"""ModelRunner: this rank's model shard and KV cache, and one forward pass per ForwardBatch."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from loraplex.kernels import cpu_gemv, select_backend
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.pooling import resolve_pooling
from loraplex.protocol.structs import ForwardBatch, ForwardReq, SlotLoad, TokenLogprob
from loraplex.worker.batch_inputs import BatchError, BatchInputs
from loraplex.worker.cuda_graphs import DecodeGraphRunner
from loraplex.worker.dist import pick_dtype
from loraplex.worker.draft_model import DraftRunner
from loraplex.worker.dummy_weights import init_dummy_weights
from loraplex.worker.eagle3_runner import Eagle3Runner
from loraplex.worker.grammar import GrammarMasks
from loraplex.worker.image_blocks import image_blocks
from loraplex.worker.images import ImageEncoder
from loraplex.worker.kv_cache import KVCache, default_kv_tokens, kv_bytes_per_token, kv_cache_dtype
from loraplex.worker.kv_scales import read_kv_scales
from loraplex.worker.layers import packed
from loraplex.worker.layers.attention import (
    AttentionBackendError,
    BatchAttention,
    SDPAAttention,
    select_attention_backend,
)
from loraplex.worker.layers.moe import device_routing_refusal, use_device_routing, warm_up_device_routing
from loraplex.worker.layers.ops import ModelOps, model_ops, select_model_ops
from loraplex.worker.loader import load_weights
from loraplex.worker.lora.draft_adapters import DraftAdapters
from loraplex.worker.lora.manager import LoRAManager
from loraplex.worker.model.config import ModelConfig, ModelConfigError
from loraplex.worker.model.qwen3_5 import GatedDeltaNet
from loraplex.worker.model.registry import build_model
from loraplex.worker.parallel import tensor_parallel
from loraplex.worker.penalties import TokenHistories, apply_penalties
from loraplex.worker.pooling import Pooler, attach_head, to_bytes
from loraplex.worker.quant import check_coverage, checkpoint_format, quantized_linears
from loraplex.worker.sampler import Sampler, prompt_logprob_rows, prompt_logprobs, token_logprobs
from loraplex.worker.sampling_batch import SamplingBatch
from loraplex.worker.sampling_table import SamplingTable
from loraplex.worker.speculative import check_drafts, draft_rows, verify_drafts
from loraplex.worker.state_cache import HybridCache, StatePlan, StateShape

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _range(values: torch.Tensor) -> str:
    return f"{values.min().item():.3g}..{values.max().item():.3g}"


class StepResult(NamedTuple):
    tokens: list[int]  # per request
    logprobs: list[TokenLogprob | None]  # per request where one asks, else []
    prompt_logprobs: list[list[TokenLogprob]]  # per request, for its prompt_logprob_ids; [] when none asks
    pooled: list[bytes] = []  # the pooling runner: per request, its pooled output where it pools (else b"")
    accepted_ids: list[list[int]] = []  # per request, its draft tokens accepted before its token; [] when none
    accepted_logprobs: list[list[TokenLogprob]] = []  # ... their logprob data where it asks; [] when none


class ModelRunner:
    def __init__(self, config: ServerConfig, model_dir: str, rank: int, world_size: int, device: torch.device | str):
        self.config = config
        self.draft: DraftRunner | Eagle3Runner | None = None  # speculative decoding's, once the KV pages are known
        self._kv_scales_pending = False  # --calculate-kv-scales until the first prefill sets them
        self.device = torch.device(device)
        self.dtype = pick_dtype(config, self.device)
        self.rank, self.world_size = rank, world_size
        self.model_config = ModelConfig.from_dir(model_dir, config.hf_overrides)
        self.pooling = resolve_pooling(config, model_dir)  # None: the generate runner
        if self.model_config.is_bidirectional and self.pooling is None:
            raise ModelConfigError(f"{self.model_config.model_type} is a bidirectional encoder: it embeds or scores "
                                   "texts and never generates; serve it with --runner pooling")  # fmt: skip
        self.quant_format = checkpoint_format(config.quantization, model_dir)
        self.context_length = self._context_length()
        self._check_divisible()
        # The one choice of LoRA backend (and with it the CPU kernels, where it builds them, for attention, norms and
        # activation), before any weight loads: a choice the device cannot run fails start-up at once.
        self.backend = select_backend(config.lora_backend, self.device, self.dtype)
        logger.info(
            "LoRA backend: %s (--lora-backend %s, %s on %s)",
            self.backend.name,
            config.lora_backend,
            str(self.dtype).removeprefix("torch."),
            self.device,
        )

        self.kv_parts, self.kv_heads, self.kv_head_dim = self.model_config.kv_layout(world_size)
        self.attention = select_attention_backend(
            config.attention_backend,
            self.device,
            self.model_config.num_heads // world_size,
            self.kv_heads,
            self.kv_head_dim,
            self.backend.cpu_kernels,
            latent_dim=self.model_config.mla.kv_lora_rank if self.model_config.mla is not None else None,
            sinks=self.model_config.attention_sinks,
            mixed_head_shapes=self.model_config.mixed_head_shapes,
            bidirectional=self.model_config.is_bidirectional,
        )
        logger.info("attention backend: %s (--attention-backend %s)", self.attention.name, config.attention_backend)
        # Gemma 3: an image's placeholders attend to each other both ways in prefill (the torch/cpu backends' mask);
        # with the triton backend, whose kernels are causal, a pass carrying images runs torch's SDPA over the same
        # paged cache (image passes run eagerly anyway)
        self.image_blocks = getattr(self.model_config.vision, "bidirectional_images", False)
        self.image_attention = self.attention
        if self.image_blocks and not isinstance(self.attention, SDPAAttention):
            self.image_attention = SDPAAttention(self.device)
            logger.info("images attend both ways within each image: passes with images run the torch attention")
        if self.image_blocks:
            self.image_attention.image_blocks = True
        # WorkerReady.images_whole: the scheduler ends no chunk inside an image's run (scheduler/image_runs.py), for
        # Gemma 3's mask above and for Gemma 4's use_bidirectional_attention "vision" (worker/image_blocks.py: its
        # sliding layers re-attend each run over the cache after the causal pass)
        self.images_whole = self.image_blocks or getattr(self.model_config.vision, "bidirectional", False)
        self.kv_dtype = self._kv_cache_dtype()
        # the norms', rotary's and activation's, bound as the layers are built
        ops = select_model_ops(self.device, self.backend.cpu_kernels)
        logger.info("model ops: %s", ops.name)

        quantization = quantized_linears(self.quant_format)
        parallel = tensor_parallel(rank, world_size, expert_parallel=config.enable_expert_parallel)
        with parallel, model_ops(ops), quantization, self.device, _default_dtype(self.dtype):
            self.model = build_model(self.model_config, max_positions=self.context_length)
            if self.pooling is not None:
                attach_head(self.model, self.pooling, self.model_config.hidden_size)
        self.pooler = Pooler(self.pooling, self.model) if self.pooling is not None else None
        if self.quant_format is not None:  # before any weight is read or drawn
            check_coverage(self.quant_format, self.model)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, self.model_config.initializer_range, config.seed)
        else:
            load_weights(self.model, model_dir, show_progress=rank == 0)
        self._log_quantization()
        self.model.eval()
        # Wraps the targeted linears in place, after the weights are loaded under their own names.
        self.lora = (
            LoRAManager(
                self.model, self.model_config, config, rank, world_size, self.device, self.dtype,
                self.backend,
            )  # fmt: skip
            if config.lora_enabled
            else None
        )
        if self.lora is not None:
            self.lora.warmup()  # Triton: every kernel variant compiled now, not inside a request's forward
        self._pack_weights()
        self._route_moe()
        # a vision-language model's images -> the rows that replace their placeholders (worker/images.py)
        self.images = ImageEncoder(self.model, self.model_config.vision, self.device, self.lora)
        logger.info(
            "loaded %s (--load-format %s): %d layers, shard %d of %d, %s on %s, context length %d",
            self.model_config.model_type,
            config.load_format,
            self.model_config.num_layers,
            rank,
            world_size,
            self.dtype,
            self.device,
            self.context_length,
        )
        moe = self.model_config.moe
        if config.enable_expert_parallel and moe is not None and world_size > 1:
            num_local = moe.num_experts // world_size
            logger.info("expert parallelism: rank %d holds experts %d..%d of %d whole", rank, rank * num_local,
                        (rank + 1) * num_local - 1, moe.num_experts)  # fmt: skip

        self.page_size = config.page_size
        self.state_plan = self._state_plan()
        num_pages = self._num_kv_tokens() // self.page_size
        if num_pages < 1:
            raise RuntimeError(f"not enough memory for one KV cache page of {self.page_size} tokens")
        kv_args = dict(
            num_layers=len(self.model_config.attention_layer_ids),  # a hybrid model's linear layers hold no KV
            num_pages=num_pages,
            page_size=self.page_size,
            num_kv_heads=self.kv_heads,
            head_dim=self.kv_head_dim,
            dtype=self.kv_dtype,
            device=self.device,
            num_parts=self.kv_parts,
        )
        if self.state_plan is None:
            self.kv_cache = KVCache(**kv_args)
        else:
            plan = self.state_plan
            self.kv_cache = HybridCache(num_state_slots=plan.num_slots, num_state_snapshots=plan.num_snapshots,
                                        state_shape=plan.shape, **kv_args)  # fmt: skip
        self._set_kv_scales(model_dir)
        self._warmup_attention()
        self._warmup_model_ops(ops)
        self._warmup_linear_attention()
        self.decode_graphs = self._decode_graphs()
        self.draft = self._draft_runner(num_pages)
        self.sampler = Sampler(config.seed, self.device)
        self.sampling_table = SamplingTable()  # every request's sampling parameters, sent on its first pass
        self.histories = TokenHistories()  # the tokens so far of the requests that use penalties
        self.grammar = GrammarMasks(model_dir, self.vocab_size, rank, world_size, self.device)
        logger.info("KV cache: %d tokens (%d pages of %d)", self.max_total_tokens, num_pages, self.page_size)
        if self.max_total_tokens < self.context_length:
            logger.warning(
                "KV cache (%d tokens) is smaller than the context length (%d)",
                self.max_total_tokens,
                self.context_length,
            )

    def _draft_runner(self, num_pages: int) -> DraftRunner | Eagle3Runner | None:
        """Speculative decoding's draft model (method draft_model) or EAGLE-3 head (eagle3), its cache on the target's
        pages; else None."""
        spec = self.config.speculation
        if spec is None or spec.method == "ngram":
            return None
        if spec.method == "eagle3":
            return Eagle3Runner(self.config, spec.model, self.model, self.model_config, num_pages=num_pages,
                                page_size=self.page_size, context_length=self.context_length, device=self.device,
                                dtype=self.dtype, cpu_kernels=self.backend.cpu_kernels)  # fmt: skip
        return DraftRunner(self.config, spec.model, vocab_size=self.vocab_size, num_pages=num_pages,
                           page_size=self.page_size, context_length=self.context_length, device=self.device,
                           dtype=self.dtype, backend=self.backend, target_lora=self.lora)  # fmt: skip

    @property
    def draft_adapters(self) -> DraftAdapters | None:
        """The draft model's adapters, loaded and dropped with the target's (None without a draft model or LoRA)."""
        return self.draft.adapters if isinstance(self.draft, DraftRunner) else None

    def _state_plan(self) -> StatePlan | None:
        """A hybrid model's state slots and snapshots: how many, and one's shape on this rank; None for a model
        without them."""
        la, ranks = self.model_config.linear_attention, self.world_size
        if la is None:
            return None
        num_slots = self.config.max_mamba_cache_size or self.config.max_running_requests
        # auto: the dtype the checkpoint names for its states (Qwen3.5's mamba_ssm_dtype), else the model's
        name = self.config.mamba_ssm_cache_dtype if self.config.mamba_ssm_cache_dtype != "auto" else la.state_dtype
        dtype = getattr(torch, name) if name in ("float32", "bfloat16", "float16") else self.dtype
        # the prefix cache's snapshots (a hit restores one): --max-state-snapshots, by default one per slot
        num_snapshots = 0
        if self.config.prefix_caching:
            num_snapshots = num_slots if self.config.max_state_snapshots is None else self.config.max_state_snapshots
        shape = StateShape(num_linear_layers=len(la.layer_ids), conv_channels=la.conv_dim // ranks,
                           conv_state_len=la.conv_kernel_size - 1, num_value_heads=la.num_value_heads // ranks,
                           key_head_dim=la.key_head_dim, value_head_dim=la.value_head_dim, dtype=dtype)  # fmt: skip
        logger.info("state slots: %d of %.2f MiB each (%d linear-attention layers, %s)", num_slots,
                    shape.slot_bytes / 2**20, len(la.layer_ids), str(dtype).removeprefix("torch."))  # fmt: skip
        logger.info("state snapshots for the prefix cache: %d (%.2f MiB)", num_snapshots,
                    num_snapshots * shape.slot_bytes / 2**20)  # fmt: skip
        return StatePlan(num_slots, num_snapshots, shape)

    @property
    def state_bytes(self) -> int:
        """What the planned state slots and snapshots take of this rank's memory (0 without them)."""
        plan = self.state_plan
        return 0 if plan is None else (plan.num_slots + plan.num_snapshots) * plan.shape.slot_bytes

    @property
    def num_state_slots(self) -> int:
        """WorkerReady.num_state_slots: a hybrid model's linear-attention state slots, else 0."""
        return self.kv_cache.num_state_slots if isinstance(self.kv_cache, HybridCache) else 0

    @property
    def num_state_snapshots(self) -> int:
        """WorkerReady.num_state_snapshots: the prefix cache's snapshots of those states, else 0."""
        return self.kv_cache.num_state_snapshots if isinstance(self.kv_cache, HybridCache) else 0

    def _route_moe(self) -> None:
        """On CUDA an MoE model routes with device ops alone (no host read per layer; what a CUDA graph captures),
        its experts in one grouped kernel, where its expert format and LoRA backend allow; on the CPU, on the host."""
        if self.model_config.moe is None or self.device.type != "cuda":
            return
        refusal = self._moe_device_refusal()
        if refusal is not None:
            logger.info("MoE layers route on the host: %s", refusal)
            return
        use_device_routing(self.model)
        start = time.perf_counter()
        launches = warm_up_device_routing(self.model)
        logger.info("MoE layers route on the device; grouped expert kernel compiled: %d launches in %.1f s", launches,
                    time.perf_counter() - start)  # fmt: skip

    def _moe_device_refusal(self) -> str | None:
        if self.lora is not None and self.backend.name != "triton":  # the others plan from host segments
            return f"--lora-backend {self.backend.name} plans expert LoRA on the host"
        return device_routing_refusal(self.model)

    def _decode_graphs(self) -> DecodeGraphRunner | None:
        if not self.config.enable_cuda_graph:
            return None
        if self.pooling is not None:
            logger.info("--enable-cuda-graph is ignored by the pooling runner: it never decodes")
            return None
        if self.model_config.linear_attention is not None:
            logger.info("--enable-cuda-graph is ignored for %s: its linear-attention layers run eagerly",
                        self.model_config.model_type)
            return None
        if self.model_config.is_bidirectional:  # an encoder computes whole sequences, never one token of decode
            logger.info("--enable-cuda-graph is ignored for %s: an encoder does not decode",
                        self.model_config.model_type)  # fmt: skip
            return None
        if self.model_config.mla is not None:  # the graphs' static metadata is built for the plain kernels
            logger.info("--enable-cuda-graph is ignored for %s: its latent attention runs eagerly",
                        self.model_config.model_type)  # fmt: skip
            return None
        if self.device.type != "cuda":
            logger.info("--enable-cuda-graph is ignored on %s: CUDA graphs need a CUDA device", self.device.type)
            return None
        if self.attention.name != "triton":
            raise AttentionBackendError(
                f"--enable-cuda-graph needs --attention-backend triton (this worker runs {self.attention.name})"
            )
        if self.lora is not None and self.backend.name != "triton":  # the torch path plans from the slot values
            raise AttentionBackendError(
                f"--enable-cuda-graph needs --lora-backend triton (this worker runs {self.backend.name})"
            )
        if self.lora is not None and self.lora.pool.vocab:
            raise AttentionBackendError("--enable-cuda-graph does not cover LoRA on embed_tokens or lm_head "
                                        f"(--lora-target-modules {' '.join(self.lora.pool.vocab)})")  # fmt: skip
        if self.model_config.moe is not None and (refusal := self._moe_device_refusal()) is not None:
            raise AttentionBackendError(f"--enable-cuda-graph cannot capture these MoE layers: {refusal}")
        return self.graph_runner(capture=True)

    @torch.inference_mode()
    def graph_runner(self, *, capture: bool, batch_sizes: list[int] | None = None) -> DecodeGraphRunner:
        """The decode graphs for this runner's model, cache and LoRA pool, at --enable-cuda-graph's batch sizes
        unless given; `capture=False` runs them eagerly through the same static buffers (tests, on a CPU)."""
        return DecodeGraphRunner(
            self._decode_step,
            self.kv_cache,
            self.lora,
            batch_sizes=batch_sizes or self.config.cuda_graph_batch_sizes or [1],
            num_kv_heads=self.kv_heads,
            context_length=self.context_length,
            device=self.device,
            capture=capture,
        )

    def _decode_step(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: BatchAttention) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_cache, attention))  # (rows, vocab)

    def _warmup_attention(self) -> None:
        start = time.perf_counter()
        launches = self.attention.warmup(
            self.kv_cache.layer(0), self.model_config.num_heads // self.world_size, self.page_size, dtype=self.dtype
        )
        if launches:
            logger.info("%s attention kernels compiled: %d launches in %.1f s", self.attention.name, launches,
                        time.perf_counter() - start)  # fmt: skip

    def _warmup_model_ops(self, ops: ModelOps) -> None:
        start = time.perf_counter()
        mc, ranks = self.model_config, self.world_size
        launches = ops.warmup(mc.hidden_size, mc.intermediate_size // ranks, mc.num_heads // ranks,
                              mc.num_kv_heads // ranks, mc.head_dim, self.dtype, self.device)  # fmt: skip
        if launches:
            logger.info("%s model op kernels compiled: %d launches in %.1f s", ops.name, launches,
                        time.perf_counter() - start)  # fmt: skip

    def _warmup_linear_attention(self) -> None:
        """A hybrid model's DeltaNet kernels, compiled on its first such layer (every one shares their variants)."""
        layer = next((m for m in self.model.modules() if isinstance(m, GatedDeltaNet)), None)
        if layer is None:
            return
        start = time.perf_counter()
        launches = layer.warmup(self.kv_cache.conv[0], self.kv_cache.recurrent[0])
        if launches:
            logger.info("%s linear-attention kernels compiled: %d launches in %.1f s", layer.mixer.name, launches,
                        time.perf_counter() - start)  # fmt: skip

    def _log_quantization(self) -> None:
        if self.quant_format is None:
            logger.info("quantization: none (plain weights)")
            return
        method, flag = self.quant_format.method, self.config.quantization
        experts = [m for m in self.model.modules() if getattr(m, "is_quantized", False)]  # ExpertsLinear's
        held = (f"expert weights {sum(m.resident_bytes for m in experts) / 2**20:.1f} MiB resident on this rank "
                f"({sum(m.num_weights for m in experts) * self.dtype.itemsize / 2**20:.1f} MiB as "
                f"{str(self.dtype).removeprefix('torch.')}), dequantized per expert at its matmul")
        if self.quant_format.experts_only:
            logger.info("quantization: %s (--quantization %s); %s", method, flag, held)
            return
        linears = [m.quant for m in self.model.modules() if getattr(m, "quant", None) is not None]
        kernels = sorted({quant.matmul.name for quant in linears})
        num_bytes = sum(quant.nbytes for quant in linears)
        logger.info("quantization: %s (--quantization %s); linear weights %.1f MiB on this rank, kernels: %s%s", method,
                    flag, num_bytes / 2**20, ", ".join(kernels), f"; {held}" if experts else "")

    def _pack_weights(self) -> None:
        if packed.gemv_unavailable_reason(self.device, self.dtype) is None:
            if self.lora is not None:  # DoRA's norms start from the plain weights, which the blocked layout replaces
                self.lora.read_base_norms()
            num_marked = packed.use_gemv(self.model)
            logger.info("%d linear weights laid out for the %s kernels (kernels/cpu_gemv.py)", num_marked,
                        cpu_gemv.isa().name)
            return
        reason = packed.unavailable_reason(self.device, self.dtype)
        if reason is not None:
            logger.info("linear weights stay plain (%s)", reason)
            return
        if self.lora is not None:  # DoRA's norms start from the plain weights, which packing frees
            self.lora.read_base_norms()
        start = time.perf_counter()
        num_packed = packed.pack_linears(self.model)
        logger.info("packed %d linear weights for oneDNN in %.1f s", num_packed, time.perf_counter() - start)

    @property
    def max_total_tokens(self) -> int:
        return self.kv_cache.num_tokens

    @property
    def kv_bytes_per_token(self) -> int:
        """Of this rank's cache, every layer with KV (a hybrid model's attention layers): what the default KV capacity
        divides memory by."""
        return kv_bytes_per_token(len(self.model_config.attention_layer_ids), self.kv_heads, self.kv_head_dim,
                                  self.kv_dtype, self.kv_parts)  # fmt: skip

    def _kv_cache_dtype(self) -> torch.dtype:
        """--kv-cache-dtype's storage dtype, or ModelConfigError where this model or device cannot hold it."""
        try:
            dtype = kv_cache_dtype(self.config.kv_cache_dtype, self.dtype)
        except ValueError as e:
            raise ModelConfigError(str(e)) from e
        if dtype == self.dtype:
            return dtype
        flag, mc = f"--kv-cache-dtype {self.config.kv_cache_dtype}", self.model_config
        if mc.mla is not None:
            raise ModelConfigError(f"{flag}: {mc.model_type}'s latent attention keeps its cache in the model's dtype "
                                   "(its kernels read no FP8); use auto")  # fmt: skip
        if mc.gemma4 is not None:
            raise ModelConfigError(f"{flag}: {mc.model_type}'s layers share and narrow one cache, which stays in the "
                                   "model's dtype; use auto")  # fmt: skip
        return dtype

    def _set_kv_scales(self, model_dir: str) -> None:
        """An FP8 cache's scales: the checkpoint's, else 1.0 (--calculate-kv-scales: the first prefill's)."""
        if not self.kv_cache.is_fp8:
            return
        if self.config.calculate_kv_scales:
            self._kv_scales_pending = True
            logger.info("FP8 KV cache: scales from the first prefill's keys and values (--calculate-kv-scales)")
            return
        scales = read_kv_scales(model_dir, self.model_config.attention_layer_ids)
        if scales is not None:
            self.kv_cache.set_scales(scales)
        logger.info("FP8 KV cache: scales %s", "from the checkpoint (k_scale, v_scale)" if scales is not None
                    else "1.0 (the checkpoint has no k_scale/v_scale; --calculate-kv-scales computes them)")

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def long_rope_len(self) -> int:
        """WorkerReady.long_rope_len: longrope's original length where the context reaches past it, else 0."""
        rope = self.model_config.rope
        original = rope.params.get("original_max_position_embeddings", 0) if rope.rope_type == "longrope" else 0
        return original if original < self.context_length else 0

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> list[int]:
        """Run the batch and return each request's next token (every rank computes the same tokens)."""
        return self.step(batch).tokens

    @torch.inference_mode()
    def step(self, batch: ForwardBatch) -> StepResult:
        """Run the batch: each request's next token, its logprob data where the request asks (else []), and the
        prompt logprobs a request asks of this pass."""
        self.sampling_table.release(batch.released_keys)
        self.histories.release(batch.released_keys)
        self.grammar.end(batch.released_keys)
        if self.draft is not None:
            self.draft.release(batch.released_keys)
        if not batch.reqs:
            self._apply_slot_loads(batch.slot_loads)
            return StepResult([], [], [])
        if self.pooler is not None:
            return self._pool_step(batch)
        # Before the forward: a request with no parameters fails the batch on every rank alike, before a collective.
        sampling = SamplingBatch.of(batch.reqs, self.sampling_table.resolve(batch.reqs), self.vocab_size, self.device)
        self.grammar.check(sampling)
        check_drafts(batch.reqs, sampling, has_draft_model=self.draft is not None)
        slot_loads = batch.slot_loads
        if self.draft is not None:  # drafts appended where asked, each on its adapter's namesake (the slots loaded)
            self._apply_slot_loads(slot_loads)
            slot_loads = []
            names = [None if self.lora is None else self.lora.slot_adapter_name(req.slot) for req in batch.reqs]
            reqs = self.draft.propose(batch.reqs, names)
        else:
            reqs = batch.reqs
        self.histories.update(reqs, sampling.history_rows)
        prompt_rows, verify_rows = prompt_logprob_rows(reqs), draft_rows(reqs)
        logits = self.logits(reqs, slot_loads, last_only=True, extra_rows=prompt_rows + verify_rows)
        num_reqs, num_prompt = len(reqs), len(prompt_rows)
        # (reqs, vocab), (prompt rows, vocab), (draft rows, vocab)
        logits, prompt_logits, draft_logits = (logits[:num_reqs], logits[num_reqs : num_reqs + num_prompt],
                                               logits[num_reqs + num_prompt :])  # fmt: skip
        # logprobs read the raw logits; a drafted request's rows are processed again, row by row, in verify_drafts
        processed = apply_penalties(logits, sampling, self.histories)
        processed = self.grammar.mask(processed, reqs, sampling)  # structured output (drafted rows: mask_drafts)
        tokens = self.sampler.sample(processed, sampling)
        tokens = self.grammar.record(reqs, sampling, tokens)
        logprobs = token_logprobs(logits, sampling, tokens)
        accepted_ids, accepted_logprobs = [], []
        if verify_rows:  # requests with drafts: their token follows the drafts accepted
            accepted_ids, accepted_logprobs = verify_drafts(reqs, sampling, logits, draft_logits, tokens, self.sampler,
                                                            logprobs, self.histories, self.grammar)  # fmt: skip
            self.grammar.record_drafts(reqs, sampling, tokens, accepted_ids)
        if self.draft is not None:  # an EAGLE-3 head keeps the features of the tokens kept
            self.draft.record(reqs, accepted_ids)
        return StepResult(tokens, logprobs, prompt_logprobs(prompt_logits, reqs, sampling),
                          accepted_ids=accepted_ids if any(accepted_ids) else [],
                          accepted_logprobs=accepted_logprobs if any(accepted_logprobs) else [])  # fmt: skip

    def _pool_step(self, batch: ForwardBatch) -> StepResult:
        """The pooling runner's pass: no sampling; each request that ends its prompt here (ForwardReq.pool) gets its
        pooled output, the others (earlier chunks) only write their KV."""
        reqs = batch.reqs
        hidden, inputs = self.hidden_states(reqs, batch.slot_loads)  # (tokens, hidden)
        if self.lora is not None:  # the head reads each request's adapter by its row (an LM head's LoRA, copies)
            self.lora.select_rows(inputs.last_token_index)
        pooled = self.pooler.pool(hidden, [len(r.input_ids) for r in reqs], inputs.last_token_index)  # (reqs, hidden)
        out = to_bytes(self.pooler.head(pooled))
        return StepResult([0] * len(reqs), [], [], [row if req.pool else b"" for req, row in zip(reqs, out,
                                                                                                 strict=True)])

    def logits(
        self, reqs: list[ForwardReq], slot_loads: list[SlotLoad], *, last_only: bool, extra_rows: list[int] = ()
    ) -> torch.Tensor:
        """(rows, vocab): each request's last token's logits and then the `extra_rows` asked for, or with
        `last_only=False` every new token's, in request order. Call under torch.inference_mode()."""
        graphs_fit = self.decode_graphs is not None and not (self.lora is not None and self.lora.uses_dora(reqs))
        graphs_fit = graphs_fit and not (self.draft is not None and self.draft.reads_target_hidden)
        if graphs_fit and not extra_rows and self.decode_graphs.can_run(reqs):
            self._apply_slot_loads(slot_loads)
            self._check_long_rope(reqs)
            return self.decode_graphs.logits(reqs)  # one token per request: every row is a last one, none extra
        hidden, inputs = self.hidden_states(reqs, slot_loads)
        if last_only:  # and after them the extra token rows asked for
            rows = inputs.last_token_index
            if extra_rows:
                rows = torch.cat([rows, torch.tensor(extra_rows, dtype=rows.dtype, device=rows.device)])
            hidden = hidden[rows]  # (reqs + extra, hidden)
            if self.lora is not None:
                self.lora.select_rows(rows)
        return self.model.compute_logits(hidden)

    def _check_long_rope(self, reqs: list[ForwardReq]) -> None:
        if not self.long_rope_len and any(req.long_rope for req in reqs):
            raise BatchError("a request asks for longrope's long factors, which this model has no use for")

    def hidden_states(self, reqs: list[ForwardReq], slot_loads: list[SlotLoad]) -> tuple[torch.Tensor, BatchInputs]:
        """The pass's final hidden states, (tokens, hidden) in request order, and its inputs. Call under
        torch.inference_mode()."""
        self._apply_slot_loads(slot_loads)
        self._check_long_rope(reqs)
        if self.model_config.is_bidirectional:
            self._check_whole_sequences(reqs)
        if "mrope_section" not in self.model_config.rope.params and any(req.mrope_positions for req in reqs):
            raise BatchError(f"a request gives M-RoPE positions, which {self.model_config.model_type} does not use")
        attention = self.attention
        if self.image_blocks and any(req.images for req in reqs):
            self._check_whole_images(reqs)
            attention = self.image_attention
        inputs = BatchInputs.build(reqs, self.page_size, self.kv_cache.num_pages, self.context_length, self.device,
                                   attention)  # fmt: skip
        if self.lora is not None:
            self.lora.prepare(reqs)
        elif any(req.slot != -1 for req in reqs):
            raise BatchError("the batch uses adapter slots but LoRA is not enabled")
        if isinstance(self.kv_cache, HybridCache):
            self.kv_cache.begin(reqs)
        # --calculate-kv-scales: the first pass with a prefill sets the FP8 cache's scales, fixed after
        calibrating = self._kv_scales_pending and any(len(req.input_ids) > 1 for req in reqs)
        self.kv_cache.is_calibrating = calibrating
        if self.model_config.is_bidirectional:  # an encoder's segments (a pair's second text); decoders have none
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attention,
                                token_type_ids=inputs.token_type_ids)  # fmt: skip
        elif (images := self.images.rows(reqs)) is not None:
            extra = {}
            if getattr(self.model_config.vision, "bidirectional", False):  # Gemma 4's image runs, seen whole
                extra["image_blocks"] = image_blocks(reqs, self.page_size, self.model_config.sliding_window or 1,
                                                     self.device)  # fmt: skip
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attention,
                                image_rows=images.rows, image_embeds=images.embeds, **extra)  # fmt: skip
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attention)
        if calibrating:
            self.kv_cache.is_calibrating = self._kv_scales_pending = False
            logger.info("FP8 KV cache scales set from the first prefill: keys %s, values %s",
                        _range(self.kv_cache.scales[:, 0]), _range(self.kv_cache.scales[:, 1]))  # fmt: skip
        return hidden, inputs  # hidden: (tokens, hidden)

    def _check_whole_images(self, reqs: list[ForwardReq]) -> None:
        """Each image's placeholders attend to the ones after them too: a pass may not end inside a run (the
        scheduler cuts chunks outside them, scheduler/image_runs.py)."""
        for i, req in enumerate(reqs):
            end = req.num_cached_tokens + len(req.input_ids)
            for image in req.images:
                if image.offset < end < image.offset + image.num_tokens:
                    raise BatchError(f"request {i}: the pass ends at {end}, inside the image placeholder run "
                                     f"[{image.offset}, {image.offset + image.num_tokens}), whose tokens attend "
                                     "to each other both ways")  # fmt: skip

    def _check_whole_sequences(self, reqs: list[ForwardReq]) -> None:
        """An encoder's request attends over its whole sequence, so it comes in one pass; its token types index the
        model's segment embeddings (checked here: on a GPU a bad index is a device-side assert)."""
        num_types = self.model_config.encoder.type_vocab_size
        for i, req in enumerate(reqs):
            if req.num_cached_tokens:
                raise BatchError(f"request {i}: a bidirectional encoder computes a sequence whole, not after "
                                 f"{req.num_cached_tokens} cached tokens")  # fmt: skip
            if req.token_type_ids and not all(0 <= t < num_types for t in req.token_type_ids):
                raise BatchError(f"request {i}: token types outside 0..{num_types - 1}")

    def _apply_slot_loads(self, slot_loads: list[SlotLoad]) -> None:
        if not slot_loads:
            return
        if self.lora is None:
            raise BatchError("the batch loads adapter slots but LoRA is not enabled")
        self.lora.apply_slot_loads(slot_loads)

    def _context_length(self) -> int:
        model_max = self.model_config.max_context_length
        if self.config.context_length is None:
            return model_max
        if self.config.context_length > model_max:
            raise ModelConfigError(
                f"--context-length {self.config.context_length} exceeds the model's maximum of {model_max}"
            )
        return self.config.context_length

    def _check_divisible(self) -> None:
        heads, kv_heads = self.model_config.num_heads, self.model_config.num_kv_heads
        la = self.model_config.linear_attention
        if la is not None and (la.num_key_heads % self.world_size or la.num_value_heads % self.world_size):
            raise ModelConfigError(f"tp {self.world_size} must divide the linear-attention key heads "
                                   f"({la.num_key_heads}) and value heads ({la.num_value_heads})")
        g4 = self.model_config.gemma4
        if g4 is not None:  # the full layers' KV heads may be fewer
            kv_heads = next((n for n in g4.kv_heads if n % self.world_size), kv_heads)
        if heads % self.world_size or kv_heads % self.world_size:
            raise ModelConfigError(
                f"tp {self.world_size} must divide the attention heads ({heads}) and KV heads ({kv_heads})"
            )
        moe = self.model_config.moe
        if self.config.enable_expert_parallel and moe is not None and moe.num_experts % self.world_size:
            raise ModelConfigError(f"--enable-expert-parallel: tp {self.world_size} must divide the experts "
                                   f"({moe.num_experts}), each rank holding the same number whole")  # fmt: skip

    def _num_kv_tokens(self) -> int:
        if self.config.gpu_memory_utilization is not None and self.device.type != "cuda":
            logger.warning("--gpu-memory-utilization %g is ignored on %s (it sizes the KV cache on CUDA)",
                           self.config.gpu_memory_utilization, self.device.type)
        if self.config.max_total_tokens is not None:
            return self.config.max_total_tokens
        num_tokens = default_kv_tokens(
            max_running_requests=self.config.max_running_requests,
            context_length=self.context_length,
            bytes_per_token=self.kv_bytes_per_token,
            device=self.device,
            gpu_memory_utilization=self.config.gpu_memory_utilization,
            reserved_bytes=self.state_bytes,  # the state slots come out of the same memory
        )
        if self.state_bytes:
            logger.info("KV budget less the state slots' and snapshots' %.2f MiB (at most %d tokens fewer)",
                        self.state_bytes / 2**20, self.state_bytes // self.kv_bytes_per_token)  # fmt: skip
        if self.world_size > 1:  # ranks measure their own memory; all must agree on one capacity
            agreed = torch.tensor([num_tokens], dtype=torch.int64, device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            num_tokens = int(agreed.item())
        return num_tokens
