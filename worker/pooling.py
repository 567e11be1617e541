"""The pooling runner's worker side: the head a pooling model gets, and the Pooler that turns a pass's final hidden
states into one output row per request that ends its prompt in it.

The interface a model implements is the one every decoder here has already: `model(input_ids, positions, kv_cache,
attention)` returns the final (normed) hidden states, (tokens, hidden), on every rank whole. Nothing else:

- `attach_head` gives the model its head as a module before the weights load: `score` (nn.Linear hidden ->
  num_labels, no bias, replicated: a `*ForSequenceClassification` checkpoint's `score.weight`) for PoolingSpec.head
  "score"; the LM head stays for "tokens" (Qwen3-Reranker's yes/no logits); an embedder and a classifier lose
  `lm_head` (their checkpoints have none). A sentence-transformers checkpoint stores the bare decoder
  (`layers.0...`, no `model.` prefix): those names load too.
- The Pooler picks the rows (PoolingSpec.pooling_type: the last new token, the first, or the mean of the request's
  tokens in this pass: the scheduler runs the prompt whole for "mean" and "cls", PoolingSpec.whole_prompt), applies
  the head, and normalises an embedding.

An encoder family (bidirectional attention) plugs in the same way: its forward returns the final hidden states; a
cross-encoder's classifier is its `score` module (or it overrides `score_head` to return its own).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from loraplex.protocol.pooling import PoolingSpec
from torch import nn

# A sentence-transformers (bare decoder) checkpoint's names -> ours
BARE_DECODER_PREFIXES = (("layers.", "model.layers."), ("embed_tokens.", "model.embed_tokens."),
                         ("norm.", "model.norm."))  # fmt: skip


def attach_head(model: nn.Module, spec: PoolingSpec, hidden_size: int) -> None:
    """Give `model` its pooling head (call before the weights load, under the model's default dtype and device)."""
    if spec.head != "tokens" and hasattr(model, "lm_head"):
        del model.lm_head  # the checkpoint has none; nothing reads the vocabulary's logits
    if spec.head == "score" and not hasattr(model, "score"):
        model.score = nn.Linear(hidden_size, spec.num_labels, bias=False)
        model.score.weight.requires_grad_(False)
    prefixes = tuple(getattr(model, "checkpoint_prefixes", ()))
    if not prefixes:  # a model with its own prefixes (a multimodal checkpoint) is never stored bare
        model.checkpoint_prefixes = BARE_DECODER_PREFIXES


def score_head(model: nn.Module) -> nn.Module:
    return model.score


class Pooler:
    def __init__(self, spec: PoolingSpec, model: nn.Module):
        self.spec = spec
        self.model = model

    def rows(self, new_lens: list[int], last_token_index: torch.Tensor) -> torch.Tensor:
        """(reqs,) the hidden row that stands for each request ("last", "cls"); "mean" reads them all."""
        if self.spec.pooling_type == "cls":
            return last_token_index - torch.tensor(new_lens, device=last_token_index.device) + 1
        return last_token_index

    def pool(self, hidden: torch.Tensor, new_lens: list[int], last_token_index: torch.Tensor) -> torch.Tensor:
        """(reqs, hidden) from the pass's (tokens, hidden): one pooled state per request."""
        if self.spec.pooling_type != "mean":
            return hidden[self.rows(new_lens, last_token_index)]
        lens = torch.tensor(new_lens, device=hidden.device)
        owner = torch.repeat_interleave(torch.arange(len(new_lens), device=hidden.device), lens)  # (tokens,)
        sums = torch.zeros(len(new_lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, owner, hidden.float())
        return sums / lens.unsqueeze(1).float()  # (reqs, hidden)

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """(reqs, out) float32: the embedding (normalised where the spec says), or the classify logits."""
        spec = self.spec
        if spec.head == "score":
            return score_head(self.model)(pooled.to(score_head(self.model).weight.dtype)).float()  # (reqs, labels)
        if spec.head == "tokens":
            logits = self.model.compute_logits(pooled).float()[:, spec.head_token_ids]  # (reqs, tokens)
            if len(spec.head_token_ids) == 2:  # softmax over the two = sigmoid of their difference
                return logits[:, 1:] - logits[:, :1]  # (reqs, 1)
            return logits
        out = pooled.float()
        return F.normalize(out, dim=-1) if spec.normalize else out  # (reqs, hidden)


def to_bytes(rows: torch.Tensor) -> list[bytes]:
    """(reqs, out) -> each row as little-endian float32 bytes (BatchResult.pooled)."""
    host = rows.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4", copy=False)
    return [row.tobytes() for row in host]
