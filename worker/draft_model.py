"""DraftRunner: speculative decoding's draft model beside the target, its own weights and KV cache.

The draft's cache has the target's pages (same count and size) and is indexed by the same page tables, so the
scheduler plans one set of pages for both. The draft runs over every pass's new tokens before the target does (prompt
chunks, recomputes and decodes alike), so its KV covers every position the target's does; a request that asks for k
drafts then takes k greedy draft steps, the last of which only writes its last draft's KV (so whatever the target
accepts, the draft's cache holds every accepted position). A greedy draft is a one-hot distribution: the target
verifies it exactly as an n-gram draft (worker/speculative.py), at any temperature.

Every rank holds the whole draft model (it is small) and computes the same drafts. Draft adapters
(worker/lora/draft_adapters.py: loaded with their target adapter, or --speculative-lora-modules by name): a request on
target adapter X drafts with X's draft adapter where there is one, else with the bare draft model; its draft KV is
always written with the same one (the prefix cache shares pages only between requests of one adapter).
"""

from __future__ import annotations

import logging

import msgspec
import torch
from loraplex.kernels import LoRABackend
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.structs import ForwardReq
from loraplex.worker.batch_inputs import BatchInputs
from loraplex.worker.kv_cache import KVCache
from loraplex.worker.layers.attention import select_attention_backend
from loraplex.worker.layers.ops import model_ops, select_model_ops
from loraplex.worker.loader import load_weights
from loraplex.worker.lora.draft_adapters import DraftAdapters
from loraplex.worker.lora.manager import LoRAManager
from loraplex.worker.model.config import ModelConfig, ModelConfigError
from loraplex.worker.model.registry import build_model

logger = logging.getLogger(__name__)


class DraftRunner:
    reads_target_hidden = False

    def __init__(self, config: ServerConfig, model_dir: str, *, vocab_size: int, num_pages: int, page_size: int,
                 context_length: int, device: torch.device, dtype: torch.dtype, backend: LoRABackend,
                 target_lora: LoRAManager | None = None) -> None:  # fmt: skip
        self.model_config = mc = ModelConfig.from_dir(model_dir)
        if mc.vocab_size != vocab_size:
            raise ModelConfigError(f"the draft model's vocabulary ({mc.vocab_size} tokens) is not the target's "
                                   f"({vocab_size}): a draft model shares the target's tokenizer")  # fmt: skip
        if mc.linear_attention is not None or mc.mla is not None or mc.moe is not None:
            raise ModelConfigError(f"a {mc.model_type} draft model is not supported: use a small dense model")
        self.device, self.page_size, self.context_length = device, page_size, context_length
        cpu_kernels = backend.cpu_kernels
        ops = select_model_ops(device, cpu_kernels)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with model_ops(ops), device:  # no tensor_parallel block: the whole model on every rank
                self.model = build_model(mc, max_positions=context_length)
        finally:
            torch.set_default_dtype(previous)
        load_weights(self.model, model_dir, show_progress=False)
        self.model.eval()
        # with LoRA on the target, the draft's own pool mirrors its slots (draft adapters at start and at run time)
        self.adapters = None if target_lora is None else DraftAdapters(
            self.model, mc, config, config.draft_lora_sources, target_lora, device, dtype, backend)
        num_parts, num_kv_heads, head_dim = mc.kv_layout(1)
        self.attention = select_attention_backend(config.attention_backend, device, mc.num_heads, num_kv_heads,
                                                  head_dim, cpu_kernels)  # fmt: skip
        self.kv_cache = KVCache(num_layers=len(mc.attention_layer_ids), num_pages=num_pages, page_size=page_size,
                                num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device,
                                num_parts=num_parts)  # fmt: skip
        logger.info("draft model %s: %d layers, its KV cache %d pages of %d", mc.model_type, mc.num_layers, num_pages,
                    page_size)  # fmt: skip

    def _last_logits(self, reqs: list[ForwardReq]) -> torch.Tensor:
        """(reqs, vocab): the draft's logits at each request's last new token, its KV written for all of them. The
        draft is a text model: a vision-language target's images and M-RoPE rows are not its (it reads placeholders
        as tokens at their indices)."""
        reqs = [msgspec.structs.replace(req, images=[], mrope_positions=[], mrope_delta=0)
                if req.images or req.mrope_positions or req.mrope_delta else req for req in reqs]  # fmt: skip
        inputs = BatchInputs.build(reqs, self.page_size, self.kv_cache.num_pages, self.context_length, self.device,
                                   self.attention)  # fmt: skip
        if self.adapters is not None:
            self.adapters.prepare(reqs, inputs.last_token_index)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.attention)  # (tokens, hidden)
        return self.model.compute_logits(hidden[inputs.last_token_index])

    def propose(self, target_reqs: list[ForwardReq], adapter_names: list[str | None]) -> list[ForwardReq]:
        """The pass's requests, each asking for num_model_drafts tokens now carrying them as its drafts (input_ids
        extended, num_draft_tokens set); the draft's cache written over every request's new tokens. Call once the
        target's slot loads of the pass are applied: the draft's slots follow them. adapter_names: unused here (the
        EAGLE-3 runner's heads go by them)."""
        reqs = target_reqs if self.adapters is None else self.adapters.bind(target_reqs)
        last = self._last_logits(reqs).argmax(dim=-1).tolist()
        drafts = {i: [last[i]] for i, req in enumerate(reqs) if req.num_model_drafts}
        # step j writes draft j's KV (at the position after the request's new tokens plus j - 1) and, but for the
        # last, proposes draft j + 1
        for j in range(1, max((r.num_model_drafts for r in reqs), default=0) + 1):
            rows = [i for i in drafts if j <= reqs[i].num_model_drafts]
            steps = [ForwardReq(input_ids=[drafts[i][j - 1]], page_ids=reqs[i].page_ids,
                                num_cached_tokens=reqs[i].num_cached_tokens + len(reqs[i].input_ids) + j - 1,
                                slot=reqs[i].slot, lora_scale=reqs[i].lora_scale)
                     for i in rows]  # fmt: skip
            tokens = self._last_logits(steps).argmax(dim=-1).tolist()
            for i, token in zip(rows, tokens, strict=True):
                if j < reqs[i].num_model_drafts:
                    drafts[i].append(token)
        return [msgspec.structs.replace(req, input_ids=req.input_ids + drafts[i], num_draft_tokens=len(drafts[i]),
                                        num_model_drafts=0, mrope_positions=_mrope_with_drafts(req, len(drafts[i])))
                if i in drafts else req for i, req in enumerate(target_reqs)]  # fmt: skip

    def record(self, reqs: list[ForwardReq], accepted_ids: list[list[int]]) -> None:
        """After the target's pass: nothing to keep (the draft reads tokens alone; its cache holds their KV)."""

    def release(self, req_keys: list[int]) -> None:
        """Requests that ended: nothing kept per request."""


def _mrope_with_drafts(req: ForwardReq, num_drafts: int) -> list[list[int]]:
    """A request's M-RoPE rows continued over its drafts: text after the prompt, index + mrope_delta in every row."""
    if not req.mrope_positions:
        return []
    first = req.num_cached_tokens + len(req.input_ids) + req.mrope_delta
    return [row + list(range(first, first + num_drafts)) for row in req.mrope_positions]
