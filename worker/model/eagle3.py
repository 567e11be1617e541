"""EAGLE-3 draft head (Li et al. 2025), in its published checkpoint format (`LlamaForCausalLMEagle3`): one Llama
decoder layer whose attention reads concat(input_layernorm(embed(token)), hidden_norm(feature)), 2 x hidden wide,
where a position's feature is fc(concat of three of the target's hidden states there: low, middle, high layers) or,
on the head's own later draft steps, its previous step's pre-norm output. Its own final norm and an LM head over a
reduced draft vocabulary, mapped to the target's by `d2t` (target id = draft id + d2t[draft id]).

Checkpoint names: `midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, input_layernorm, hidden_norm,
post_attention_layernorm}`, `fc`, `norm`, `lm_head`, `d2t`, `t2d` (the inverse mask, unused here), and optionally
`embed_tokens` (else the target's embedding is read). Like every model here, it knows nothing of TP or LoRA: it runs
whole on every rank."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from loraplex.worker.kv_cache import KVLayer
from loraplex.worker.layers.attention import BatchAttention
from loraplex.worker.layers.embedding import Embedding, LMHead
from loraplex.worker.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from loraplex.worker.layers.norm import RMSNorm
from loraplex.worker.layers.rotary import RotaryEmbedding
from loraplex.worker.loader import checkpoint_files
from loraplex.worker.model.config import ModelConfig, ModelConfigError
from loraplex.worker.model.llama import LlamaAttention, LlamaMLP, layer_attention
from safetensors import safe_open
from torch import nn

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Config:
    model: ModelConfig  # the head's layer: hidden size, heads, rope, norms' eps
    draft_vocab_size: int
    target_hidden_size: int  # of each of the three target hidden states fc reads
    aux_layer_ids: tuple[int, int, int]  # the target layers whose outputs are read
    norm_before_residual: bool  # the feature enters the residual stream normed (some heads are trained so)
    has_embedding: bool  # the checkpoint carries embed_tokens; else the target's is read
    has_d2t: bool  # else the draft vocabulary is the target's

    @classmethod
    def from_dir(cls, head_dir: str, target: ModelConfig) -> Eagle3Config:
        """The head's config.json against the target it drafts for; ModelConfigError naming what does not fit."""
        try:
            with open(os.path.join(head_dir, "config.json")) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ModelConfigError(f"EAGLE-3 head {head_dir!r}: no readable config.json ({e})") from e
        if not set(raw.get("architectures") or ()) & set(ARCHITECTURES):
            raise ModelConfigError(f"EAGLE-3 head {head_dir!r}: architectures {raw.get('architectures')} is not one "
                                   f"of {', '.join(ARCHITECTURES)}")  # fmt: skip
        model = ModelConfig.from_dir(head_dir)
        if model.vocab_size != target.vocab_size:
            raise ModelConfigError(f"EAGLE-3 head {head_dir!r}: its vocabulary ({model.vocab_size}) is not the "
                                   f"target's ({target.vocab_size})")  # fmt: skip
        target_hidden = raw.get("target_hidden_size") or model.hidden_size
        if target_hidden != target.hidden_size:
            raise ModelConfigError(f"EAGLE-3 head {head_dir!r} reads hidden states of size {target_hidden}, the "
                                   f"target's are {target.hidden_size}")  # fmt: skip
        eagle = raw.get("eagle_config") or {}
        layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_aux_hidden_state_layer_ids")
        num_layers = target.num_layers
        if layer_ids is None:  # the outputs of the layers before 2, L/2 and L-3, clamped for small targets
            layer_ids = [min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4)]
        if len(layer_ids) != 3 or not all(isinstance(i, int) and 0 <= i < num_layers for i in layer_ids):
            raise ModelConfigError(f"EAGLE-3 head {head_dir!r}: eagle_aux_hidden_state_layer_ids {layer_ids} must "
                                   f"be three layers of the target's 0..{num_layers - 1}")  # fmt: skip
        with safe_open(checkpoint_files(head_dir)[0], framework="pt") as f:
            names = set(f.keys())
        return cls(model=model, draft_vocab_size=raw.get("draft_vocab_size") or model.vocab_size,
                   target_hidden_size=target_hidden, aux_layer_ids=tuple(layer_ids),
                   norm_before_residual=bool(raw.get("norm_before_residual", False)),
                   has_embedding="embed_tokens.weight" in names, has_d2t="d2t" in names)  # fmt: skip


class Eagle3Layer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary, layer_attention(config, 0))
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        # its q/k/v read the embedding and the feature side by side
        self.self_attn.qkv_proj = MergedColumnParallelLinear(2 * config.hidden_size, [q_size, kv_size, kv_size],
                                                             bias=config.qkv_bias)  # fmt: skip
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)


class Eagle3Head(nn.Module):
    # t2d (target -> draft mask) says nothing d2t does not
    checkpoint_prefixes = (("t2d", None),)

    def __init__(self, config: Eagle3Config, max_positions: int):
        super().__init__()
        mc = config.model
        self.config = config
        if config.has_embedding:
            self.embed_tokens = Embedding(mc.vocab_size, mc.hidden_size)
        self.fc = ReplicatedLinear(3 * config.target_hidden_size, mc.hidden_size)
        self.midlayer = Eagle3Layer(mc, RotaryEmbedding(mc.head_dim, max_positions, mc.rope))
        self.norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        self.lm_head = LMHead(config.draft_vocab_size, mc.hidden_size)
        if config.has_d2t:
            self.d2t = nn.Parameter(torch.zeros(config.draft_vocab_size, dtype=torch.int64), requires_grad=False)

    def features(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """(rows, 3 x target hidden): the target's three hidden states side by side -> (rows, hidden)."""
        return self.fc(aux_hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor, embedding: torch.Tensor,
                kv: KVLayer, attention: BatchAttention) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """input_ids (tokens,), features (tokens, hidden): position p reads the token at p + 1 and the feature at p.
        Returns (normed, pre-norm) outputs (tokens, hidden) each: the first gives the logits of the token at p + 2,
        the second is the feature of the head's next step. `embedding`: the target's, when the head has none."""
        layer = self.midlayer
        embeds = F.embedding(input_ids, self.embed_tokens.weight if self.config.has_embedding else embedding)
        normed_features = layer.hidden_norm(features)
        residual = normed_features if self.config.norm_before_residual else features
        hidden = torch.cat([layer.input_layernorm(embeds), normed_features], dim=-1)  # (tokens, 2 x hidden)
        hidden = layer.self_attn(positions, hidden, kv, attention)
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        return self.norm(layer.mlp(hidden), residual)

    def draft_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """(rows, hidden) -> (rows,) each row's greedy draft, as a target token id."""
        best = self.lm_head(normed).argmax(dim=-1)  # in the draft vocabulary
        return best + self.d2t[best] if self.config.has_d2t else best
