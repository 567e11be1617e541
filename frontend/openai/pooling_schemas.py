"""The request bodies of the pooling routes (frontend/entrypoints/pooling_api.py): OpenAI's embeddings, vLLM's
/pooling, /score, /rerank and /classify, Jina's and Cohere's rerank shapes. Strict like every body here."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from loraplex.frontend.params import Strict, TokenId

# -1: the whole context (vLLM's); k >= 1: the prompt's last k tokens
TruncateTokens = Annotated[int, msgspec.Meta(ge=-1)]
Dimensions = Annotated[int, msgspec.Meta(ge=1)]
TopN = Annotated[int, msgspec.Meta(ge=0)]
# string | list of strings | token ids | list of token-id lists (msgspec takes one list type: the service checks the
# list is one of the three)
PoolingInput = str | list[str | TokenId | list[TokenId]]


class EmbeddingRequest(Strict, kw_only=True):
    input: PoolingInput
    model: str | None = None  # the base model or an adapter; none: the base model
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Dimensions | None = None  # Matryoshka: the first `dimensions` values, normalised again
    user: str | None = None  # accepted, unused (OpenAI's end-user id)
    truncate_prompt_tokens: TruncateTokens | None = None
    normalize: bool | None = None  # vLLM's: None = as the model's pooling config says


class ClassifyRequest(Strict, kw_only=True):
    input: PoolingInput
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: TruncateTokens | None = None


class ScoreRequest(Strict, kw_only=True):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: TruncateTokens | None = None


class CohereDocument(Strict, kw_only=True):
    text: str


class RerankRequest(Strict, kw_only=True):
    query: str
    documents: list[str | CohereDocument]
    model: str | None = None
    top_n: TopN | None = None  # the best n results; none or 0: all
    return_documents: bool = True
    user: str | None = None
    truncate_prompt_tokens: TruncateTokens | None = None
    # Cohere's; here as truncate_prompt_tokens (when that is not given): each scored prompt keeps its last this many
    max_tokens_per_doc: TruncateTokens | None = None
