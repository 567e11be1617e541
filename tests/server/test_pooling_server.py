"""The pooling runner end to end, one server per kind: a sentence-transformers Qwen3 embedder at TP=2 with two
adapters (its outputs equal sentence-transformers and PEFT; the openai client and LangChain unchanged; the bad inputs),
and a Qwen3 yes/no reranker with an adapter (a Cohere-style /v2/rerank, /score and /classify equal HF + PEFT)."""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from loraplex.frontend.pooling import MAX_INPUTS
from loraplex.protocol.pooling import qwen3_reranker_prompt

from tests.builders import build_lora_adapter
from tests.pooling_models import (
    RERANKER_OVERRIDES,
    build_reranker,
    build_st_embedder,
    hf_yes_no_scores,
    peft_embeddings,
    st_embeddings,
)
from tests.server_utils import CHUNKED_ARGS, ServerProcess

TEXTS = ["The morning was cold and clear, and the old farmer walked slowly down the lane.", "hello world", "a",
         "He wrote quickly, then stopped, crossed out a line and started again."]  # fmt: skip
TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("pooling_embedder")
    model_dir = root / "embedder"
    causal = build_st_embedder(model_dir)
    adapters = {name: root / name for name in ("a", "b")}
    for seed, path in enumerate(adapters.values(), start=1):
        build_lora_adapter(causal, path, r=8, lora_alpha=16, target_modules=TARGETS, seed=seed)
    with ServerProcess("--model-path", str(model_dir), "--tp", "2", "--lora-paths",
                       *[f"{n}={p}" for n, p in adapters.items()], *CHUNKED_ARGS) as server:  # fmt: skip
        yield server, model_dir, causal, adapters


def embed(server: ServerProcess, **body) -> dict:
    resp = server.post("/v1/embeddings", body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def cosines(ours: list[list[float]], ref: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(torch.tensor(ours), ref.float(), dim=-1)


def test_embeddings_at_tp2_equal_sentence_transformers_and_peft(embedder) -> None:
    server, model_dir, causal, adapters = embedder
    from transformers import AutoTokenizer

    prompts = [AutoTokenizer.from_pretrained(model_dir)(t)["input_ids"] for t in TEXTS]
    with ThreadPoolExecutor(3) as pool:  # the three models' requests run side by side (batched across adapters)
        futures = {name: pool.submit(embed, server, model=name or "embedder", input=TEXTS)
                   for name in (None, "a", "b")}  # fmt: skip
        answers = {name: f.result() for name, f in futures.items()}
    base = answers[None]
    assert base["model"] == "embedder" and base["object"] == "list" and len(base["data"]) == len(TEXTS)
    assert base["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert (cosines([d["embedding"] for d in base["data"]], st_embeddings(model_dir, TEXTS)) > 1 - 1e-4).all()
    for name in ("a", "b"):
        ours = [d["embedding"] for d in answers[name]["data"]]
        assert (cosines(ours, peft_embeddings(causal, prompts, adapters[name])) > 1 - 1e-4).all()
    # token ids, base64, Matryoshka dimensions, truncation
    by_ids = embed(server, model="a", input=prompts[:2], encoding_format="base64")
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in by_ids["data"]]
    np.testing.assert_allclose(decoded, [d["embedding"] for d in answers["a"]["data"][:2]], atol=1e-5)
    cut = np.array(embed(server, model="a", input=TEXTS[0], dimensions=16)["data"][0]["embedding"])
    full = np.array(answers["a"]["data"][0]["embedding"][:16])
    np.testing.assert_allclose(cut, full / np.linalg.norm(full), atol=1e-5)
    short = embed(server, input=TEXTS[0], truncate_prompt_tokens=5)
    assert short["usage"]["prompt_tokens"] == 5
    metrics = server.get("/metrics").text
    assert 'loraplex_adapter_requests_total{adapter="a"}' in metrics


def test_openai_client_and_langchain_against_an_adapter(embedder) -> None:
    server, *_ = embedder
    import openai
    from langchain_openai import OpenAIEmbeddings

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    reference = embed(server, model="b", input=TEXTS)["data"]
    got = client.embeddings.create(model="b", input=TEXTS)
    assert [d.index for d in got.data] == list(range(len(TEXTS)))
    np.testing.assert_allclose([d.embedding for d in got.data], [d["embedding"] for d in reference], atol=1e-5)
    # LangChain: its tiktoken pre-tokenisation is for OpenAI's models; a compatible server takes the texts
    lc = OpenAIEmbeddings(model="b", base_url=server.url + "/v1", api_key="unused", check_embedding_ctx_length=False)
    np.testing.assert_allclose(lc.embed_documents(TEXTS[:2]), [d["embedding"] for d in reference[:2]], atol=1e-5)
    np.testing.assert_allclose(lc.embed_query(TEXTS[1]), reference[1]["embedding"], atol=1e-5)


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/embeddings", {"input": []}, 400, "empty"),
    ("/v1/embeddings", {"input": ["x"] * (MAX_INPUTS + 1)}, 400, f"at most {MAX_INPUTS}"),
    ("/v1/embeddings", {"input": [5] * 300}, 400, "context"),
    ("/v1/embeddings", {"input": 5}, 400, "invalid request"),
    ("/v1/embeddings", {"input": [1, "a"]}, 400, "not a mix"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "dimensions": 65}, 400, "dimensions"),
    ("/v1/embeddings", {"input": "x", "model": "nope"}, 404, "does not exist"),
    ("/v1/completions", {"model": "embedder", "prompt": "x", "max_tokens": 2}, 400, "pooling runner"),
    ("/generate", {"text": "x"}, 400, "pooling runner"),
    ("/classify", {"input": "x"}, 400, "served for embed"),
    ("/v1/score", {"text_1": "x", "text_2": []}, 400, "empty"),
])  # fmt: skip
def test_bad_input_is_a_400(embedder, path: str, body: dict, status: int, words: str) -> None:
    server, *_ = embedder
    resp = server.post(path, body)
    assert resp.status_code == status, resp.text
    assert words in json.dumps(resp.json()), resp.text
    assert server.get("/health").status_code == 200


def test_score_of_an_embedder_is_the_cosine(embedder) -> None:
    server, *_ = embedder
    scores = server.post("/v1/score", {"model": "a", "text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()["data"]
    vectors = np.array([d["embedding"] for d in embed(server, model="a", input=TEXTS)["data"]])
    np.testing.assert_allclose([d["score"] for d in scores], vectors[1:] @ vectors[0], atol=1e-5)


# ---- a yes/no reranker -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("pooling_reranker")
    model_dir = root / "reranker"
    build_reranker(model_dir)
    adapter = root / "r1"
    build_lora_adapter(model_dir, adapter, r=8, lora_alpha=16, target_modules=TARGETS, seed=7)
    with ServerProcess("--model-path", str(model_dir), "--hf-overrides", json.dumps(RERANKER_OVERRIDES),
                       "--lora-paths", f"r1={adapter}", *CHUNKED_ARGS) as server:  # fmt: skip
        yield server, model_dir, adapter


def reference_scores(model_dir: Path, adapter: Path | None, query: str, documents: list[str]) -> list[float]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(qwen3_reranker_prompt(query, d), add_special_tokens=False)["input_ids"] for d in documents]
    yes_id, no_id = tokenizer.convert_tokens_to_ids(["yes", "no"])
    return hf_yes_no_scores(model_dir, prompts, yes_id, no_id, adapter).tolist()


def test_cohere_rerank_score_and_classify_equal_hf(reranker) -> None:
    server, model_dir, adapter = reranker
    query, documents = TEXTS[0], TEXTS[1:]
    resp = server.post("/v2/rerank", {"model": "r1", "query": query, "documents": documents, "top_n": 2,
                                      "return_documents": True})  # fmt: skip
    assert resp.status_code == 200, resp.text
    results = resp.json()["results"]
    ref = reference_scores(model_dir, adapter, query, documents)
    best = sorted(range(len(documents)), key=lambda i: -ref[i])[:2]
    assert [r["index"] for r in results] == best
    np.testing.assert_allclose([r["relevance_score"] for r in results], [ref[i] for i in best], atol=1e-4)
    assert [r["document"]["text"] for r in results] == [documents[i] for i in best]
    base_ref = reference_scores(model_dir, None, query, documents)
    scores = server.post("/score", {"text_1": query, "text_2": documents}).json()["data"]
    np.testing.assert_allclose([d["score"] for d in scores], base_ref, atol=1e-4)
    classes = server.post("/classify", {"input": [qwen3_reranker_prompt(query, documents[0])]})
    assert classes.status_code == 200, classes.text
    [item] = classes.json()["data"]
    assert item["label"] == "yes" and item["num_classes"] == 1
    resp = server.post("/v1/embeddings", {"input": "x"})
    assert resp.status_code == 400 and "served for classify" in resp.text
