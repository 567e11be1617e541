"""BERT: a bidirectional encoder over flat token batches, hidden states (tokens, hidden), each sequence whole in one
pass.

Embeddings (word + absolute position + token type, then LayerNorm), then post-LN layers: x = LN(x + attn(x)),
x = LN(x + down(gelu(up(x)))). Attention is not causal: every token sees its whole sequence (LayerAttention.is_causal
False), through the same paged attention as the decoders. The model returns the last hidden states, which the
pooling runner (worker/pooling.py) pools: `BertEmbedder` (BertModel, sentence-transformers' pooling and
normalisation) or `BertCrossEncoder` (BertForSequenceClassification, whose `score` head is BERT's pooler, dense +
tanh on the first token, then its classifier).

Our module names are the decoders' (self_attn.qkv_proj, self_attn.o_proj, mlp.up_proj, mlp.down_proj), so tensor
parallelism and LoRA (worker/lora/targets.py) treat them as any family's; the checkpoint's names are mapped at load
(`checkpoint_prefixes`, `checkpoint_renames`), and an adapter's by protocol/adapters (query -> q_proj, ...)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraplex.worker.kv_cache import KVCache
from loraplex.worker.layers.attention import BatchAttention, paged_attention
from loraplex.worker.layers.attention_spec import LayerAttention
from loraplex.worker.layers.embedding import Embedding
from loraplex.worker.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from loraplex.worker.model.config import ModelConfig
from torch import nn

# checkpoint prefix -> ours (None: not loaded). BertForSequenceClassification's tensors sit under `bert.`; a
# BertModel's (sentence-transformers) at the top level. Older checkpoints keep the position_ids buffer.
_ENCODER_PREFIXES = (
    ("bert.embeddings.position_ids", None),
    ("embeddings.position_ids", None),
    ("bert.encoder.layer.", "model.layers."),
    ("encoder.layer.", "model.layers."),
    ("bert.embeddings.", "model."),
    ("embeddings.", "model."),
    ("bert.pooler.", "pooler."),
)
# checkpoint module path part -> ours; the first that a name holds is replaced (attention.output.* before output.*)
_RENAMES = (
    ("attention.self.query", "self_attn.q_proj"),
    ("attention.self.key", "self_attn.k_proj"),
    ("attention.self.value", "self_attn.v_proj"),
    ("attention.output.dense", "self_attn.o_proj"),
    ("attention.output.LayerNorm", "attn_norm"),
    ("intermediate.dense", "mlp.up_proj"),
    ("output.dense", "mlp.down_proj"),
    ("output.LayerNorm", "mlp_norm"),
    ("model.word_embeddings", "model.embed_tokens"),
    ("model.LayerNorm", "model.embed_norm"),
)


class BertAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim = config.head_dim
        size = config.num_heads * config.head_dim
        self.qkv_proj = MergedColumnParallelLinear(config.hidden_size, [size, size, size], bias=True)
        self.o_proj = RowParallelLinear(size, config.hidden_size, bias=True)
        self.layer = LayerAttention(scale=config.head_dim**-0.5, is_causal=False)

    def forward(self, hidden: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], attention: BatchAttention
                ) -> torch.Tensor:  # fmt: skip
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # (tokens, 3 * heads * head_dim) of this shard
        q, k, v = (t.view(num_tokens, -1, self.head_dim) for t in qkv.split(self.qkv_proj.output_sizes_per_rank, -1))
        out = paged_attention(q, k, v, kv[0], kv[1], attention, self.layer)  # (tokens, heads, head_dim)
        return self.o_proj(out.reshape(num_tokens, -1))  # (tokens, hidden)


class BertMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size], bias=True)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(hidden)))  # exact (erf) GELU, BERT's "gelu"


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        eps = config.encoder.layer_norm_eps
        self.self_attn = BertAttention(config)
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = BertMLP(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=eps)

    def forward(self, hidden: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], attention: BatchAttention
                ) -> torch.Tensor:  # fmt: skip
        hidden = self.attn_norm(hidden + self.self_attn(hidden, kv, attention))  # post-LN
        return self.mlp_norm(hidden + self.mlp(hidden))  # (tokens, hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden = config.hidden_size
        self.embed_tokens = Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(config.encoder.type_vocab_size, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=config.encoder.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))

    def forward(
        self,
        input_ids: torch.Tensor,  # (tokens,)
        positions: torch.Tensor,  # (tokens,) from 0 in each sequence
        kv_cache: KVCache,
        attention: BatchAttention,
        token_type_ids: torch.Tensor | None = None,  # (tokens,); None: all 0 (single texts)
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) + self.position_embeddings(positions)  # (tokens, hidden)
        if token_type_ids is None:
            hidden = hidden + self.token_type_embeddings.weight[0]
        else:
            hidden = hidden + self.token_type_embeddings(token_type_ids)
        hidden = self.embed_norm(hidden)
        for layer_id, layer in enumerate(self.layers):
            hidden = layer(hidden, kv_cache.layer(layer_id), attention)
        return hidden  # (tokens, hidden)


class BertEmbedder(nn.Module):
    """BertModel: the encoder's last hidden states, which the pooling runner pools into one vector per text."""

    checkpoint_prefixes = (*_ENCODER_PREFIXES, ("pooler.", None))  # BertModel's pooler: unused by embeddings
    checkpoint_renames = _RENAMES

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.model = BertEncoder(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, attention: BatchAttention,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        return self.model(input_ids, positions, kv_cache, attention, token_type_ids)  # (tokens, hidden)


class BertScoreHead(nn.Module):
    """A BERT classifier's head on the first token's state: tanh(pooler.dense(x)), then the classifier's logits."""

    def __init__(self, hidden_size: int, num_labels: int):
        super().__init__()
        self.pooler = nn.Module()
        self.pooler.dense = ReplicatedLinear(hidden_size, hidden_size, bias=True)
        self.classifier = ReplicatedLinear(hidden_size, num_labels, bias=True)
        self.out_features = num_labels

    @property
    def weight(self) -> torch.Tensor:  # what the pooling runner reads the head's dtype from
        return self.classifier.weight

    def forward(self, first_token: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler.dense(first_token)))  # (seqs, labels)


class BertCrossEncoder(BertEmbedder):
    """BertForSequenceClassification: a cross-encoder for one label; its head is the pooling runner's `score`."""

    checkpoint_prefixes = (*_ENCODER_PREFIXES, ("classifier.", "score.classifier."))
    checkpoint_renames = (*_RENAMES, ("pooler.dense", "score.pooler.dense"))

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__(config, max_positions)
        self.score = BertScoreHead(config.hidden_size, config.encoder.num_labels)


def bert_model_class(config: ModelConfig) -> type[nn.Module]:
    return BertCrossEncoder if config.encoder.is_classifier else BertEmbedder
