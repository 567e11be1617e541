"""The pooling runner's routes (frontend/pooling.py does the work): OpenAI's and SGLang's /v1/embeddings, vLLM's
/pooling, /score and /v1/score, /rerank with /v1/rerank and /v2/rerank (Jina's and Cohere's shapes), /classify.
Errors in OpenAI's shape, as vLLM answers on all of them."""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np
from aiohttp import web
from loraplex.frontend.entrypoints.http_utils import error_response, json_response, read_request, service_of
from loraplex.frontend.errors import InputError
from loraplex.frontend.generate import GenerationFailed
from loraplex.frontend.openai.pooling_schemas import ClassifyRequest, EmbeddingRequest, RerankRequest, ScoreRequest
from loraplex.frontend.pooling import PoolingResult, PoolingService

routes = web.RouteTableDef()
# vLLM's routes outside /v1/: their errors take vLLM's statuses too
VLLM_PATHS = frozenset({"/pooling", "/score", "/rerank", "/v2/rerank", "/classify"})


def pooling_of(request: web.Request) -> PoolingService:
    return PoolingService(service_of(request))


def _envelope(result: PoolingResult, data: list[dict], prefix: str) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": result.model, "data": data, "usage": result.usage}  # fmt: skip


async def _answer(make) -> web.Response:
    try:
        return json_response(await make())
    except GenerationFailed as e:
        return error_response(str(e), e.status)


def _vector(row: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
    return row.tolist()


@routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    body = await read_request(request, EmbeddingRequest)
    pooling = pooling_of(request)

    async def make() -> dict:
        pooling.need_task("embed", "/v1/embeddings")
        result = await pooling.embed(body.model, pooling.prompts(body.input, body.truncate_prompt_tokens),
                                     body.dimensions, body.normalize)  # fmt: skip
        data = [{"object": "embedding", "index": i, "embedding": _vector(row, body.encoding_format)}
                for i, row in enumerate(result.rows)]  # fmt: skip
        return _envelope(result, data, "embd")

    return await _answer(make)


@routes.post("/pooling")
async def pooling_route(request: web.Request) -> web.Response:
    """The pooler's output as it is: an embedding, or a classifier's probabilities."""
    body = await read_request(request, EmbeddingRequest)
    pooling = pooling_of(request)

    async def make() -> dict:
        prompts = pooling.prompts(body.input, body.truncate_prompt_tokens)
        if pooling.spec.task == "embed":
            result = await pooling.embed(body.model, prompts, body.dimensions, body.normalize)
        else:
            result = await pooling.classify(body.model, prompts)
        data = [{"object": "pooling", "index": i, "data": _vector(row, body.encoding_format)}
                for i, row in enumerate(result.rows)]  # fmt: skip
        return _envelope(result, data, "pool")

    return await _answer(make)


@routes.post("/classify")
async def classify(request: web.Request) -> web.Response:
    body = await read_request(request, ClassifyRequest)
    pooling = pooling_of(request)

    async def make() -> dict:
        spec = pooling.need_task("classify", "/classify")
        result = await pooling.classify(body.model, pooling.prompts(body.input, body.truncate_prompt_tokens))
        data = []
        for i, probs in enumerate(result.rows):
            label = spec.labels[int(np.argmax(probs))] if spec.num_labels > 1 else spec.labels[0]
            data.append({"index": i, "label": label, "probs": probs.tolist(), "num_classes": len(probs)})
        return _envelope(result, data, "classify")

    return await _answer(make)


def _pairs(text_1: str | list[str], text_2: str | list[str]) -> tuple[list[str], list[str]]:
    """vLLM's pairing: one against many, or two lists of one length zipped."""
    firsts = [text_1] if isinstance(text_1, str) else text_1
    seconds = [text_2] if isinstance(text_2, str) else text_2
    if not firsts or not seconds:
        raise InputError("text_1 and text_2 must not be empty")
    if len(firsts) == 1:
        return firsts * len(seconds), seconds
    if len(firsts) != len(seconds):
        raise InputError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many as "
                         "text_2")  # fmt: skip
    return firsts, seconds


@routes.post("/score")
@routes.post("/v1/score")
async def score(request: web.Request) -> web.Response:
    body = await read_request(request, ScoreRequest)
    pooling = pooling_of(request)

    async def make() -> dict:
        firsts, seconds = _pairs(body.text_1, body.text_2)
        result = await pooling.score(body.model, firsts, seconds, body.truncate_prompt_tokens)
        data = [{"index": i, "object": "score", "score": float(row[0])} for i, row in enumerate(result.rows)]
        return _envelope(result, data, "score")

    return await _answer(make)


@routes.post("/rerank")
@routes.post("/v1/rerank")
@routes.post("/v2/rerank")
async def rerank(request: web.Request) -> web.Response:
    body = await read_request(request, RerankRequest)
    pooling = pooling_of(request)

    async def make() -> dict:
        documents = [d if isinstance(d, str) else d.text for d in body.documents]
        if not documents:
            raise InputError("'documents' is an empty list")
        truncate = body.truncate_prompt_tokens if body.truncate_prompt_tokens is not None else body.max_tokens_per_doc
        result = await pooling.score(body.model, [body.query] * len(documents), documents, truncate)
        scores = [float(row[0]) for row in result.rows]
        order = sorted(range(len(documents)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[: body.top_n]
        results = []
        for i in order:
            item = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                item["document"] = {"text": documents[i]}
            results.append(item)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": result.model, "results": results,
                "usage": {"prompt_tokens": result.num_prompt_tokens, "total_tokens": result.num_prompt_tokens},
                "meta": {"billed_units": {"search_units": 1}}}  # fmt: skip

    return await _answer(make)
