"""BERT served by the pooling runner with adapters, through real clients: the `openai` client's embeddings.create on
an adapter of a sentence-transformers embedder equals SentenceTransformer.encode with it, and a Cohere-style /rerank
on an adapter of a cross-encoder equals CrossEncoder.predict with it (the pair's token types reach the model), and so
does /score on an adapter with its own classifier loaded at run time; a text over the context is a 400."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch

from tests.bert_models import TINY_BERT, build_bert_head_adapter, cross_encoder_scores, st_embeddings, words
from tests.server_utils import ServerProcess

TOL = 1e-4
SERVER_ARGS = ("--page-size", "4", "--max-total-tokens", "1024")


@pytest.fixture(scope="module")
def embedder(bert_embedder: tuple[Path, dict[str, Path]]):
    model_dir, adapters = bert_embedder
    with ServerProcess("--model-path", str(model_dir), "--lora-paths", f"a8={adapters['a8']}",
                       *SERVER_ARGS) as server:  # fmt: skip
        yield server, model_dir, adapters["a8"]


@pytest.fixture(scope="module")
def reranker(bert_cross_encoder: tuple[Path, dict[str, Path]]):
    model_dir, adapters = bert_cross_encoder
    with ServerProcess("--model-path", str(model_dir), "--lora-paths", f"a4={adapters['a4']}",
                       *SERVER_ARGS) as server:  # fmt: skip
        yield server, model_dir, adapters["a4"]


def test_openai_embeddings_on_an_adapter_equal_sentence_transformers(embedder) -> None:
    server, model_dir, adapter_dir = embedder
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    texts = [words(n, seed) for seed, n in enumerate((4, 11, 2))]
    response = client.embeddings.create(model="a8", input=texts)
    ours = torch.tensor([item.embedding for item in response.data])
    ref = st_embeddings(model_dir, texts, adapter_dir)
    assert (1 - torch.nn.functional.cosine_similarity(ours, ref, dim=-1)).max().item() < TOL
    assert response.usage.prompt_tokens == sum(n + 2 for n in (4, 11, 2))  # [CLS] text [SEP]
    # past max_position_embeddings: a clear 400
    too_long = server.post("/v1/embeddings", json={"model": "a8", "input": words(TINY_BERT["max_position_embeddings"],
                                                                                   9)})  # fmt: skip
    assert too_long.status_code == 400, too_long.text


def test_rerank_on_an_adapter_equals_cross_encoder(reranker) -> None:
    server, model_dir, adapter_dir = reranker
    query = words(3, 20)
    documents = [words(n, 30 + n) for n in (6, 2, 9, 4)]
    response = server.post("/v1/rerank", json={"model": "a4", "query": query, "documents": documents, "top_n": 3,
                                               "return_documents": True})  # fmt: skip
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    ref = cross_encoder_scores(model_dir, [(query, d) for d in documents], adapter_dir)[:, 0]
    assert [r["index"] for r in results] == ref.argsort(descending=True)[:3].tolist()
    for r in results:
        assert abs(r["relevance_score"] - ref[r["index"]].item()) < TOL, (r, ref)
        assert r["document"]["text"] == documents[r["index"]]
    base = cross_encoder_scores(model_dir, [(query, d) for d in documents])[:, 0]
    assert (ref - base).abs().max().item() > 1e-3  # the adapter's effect is in what was compared


def test_score_on_an_adapter_with_its_own_classifier_loaded_at_run_time(reranker, tmp_path: Path) -> None:
    # a PEFT SEQ_CLS adapter (its own classifier and pooler.dense), loaded into the running server: /score on it
    # and on the base equal CrossEncoder.predict with it and without
    server, model_dir, _ = reranker
    head_dir = tmp_path / "head"
    build_bert_head_adapter(model_dir, head_dir, seed=21, target_modules=("query", "value"))  # the pool a4 sized
    loaded = server.post("/load_lora_adapter", {"lora_name": "head", "lora_path": str(head_dir)})
    assert loaded.status_code == 200, loaded.text
    query = words(4, 40)
    documents = [words(n, 41 + n) for n in (5, 3, 8)]
    pairs = [(query, d) for d in documents]
    for model, adapter_dir in (("head", head_dir), (None, None)):
        response = server.post("/score", {"text_1": query, "text_2": documents, **({"model": model} if model else {})})
        assert response.status_code == 200, response.text
        ours = torch.tensor([d["score"] for d in response.json()["data"]])
        ref = cross_encoder_scores(model_dir, pairs, adapter_dir)[:, 0]
        torch.testing.assert_close(ours, ref, atol=TOL, rtol=0)
    base = cross_encoder_scores(model_dir, pairs)[:, 0]
    assert (cross_encoder_scores(model_dir, pairs, head_dir)[:, 0] - base).abs().max().item() > 1e-2
