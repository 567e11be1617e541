"""BERT in the pooling runner against sentence-transformers in fp32, the base model and two adapters in one batch:
a sentence-transformers embedder (mean pooling, normalised) against SentenceTransformer.encode, and a cross-encoder
(BertForSequenceClassification, one label) against CrossEncoder.predict, each adapter through peft; a PEFT SEQ_CLS
adapter with its own classifier and pooler (modules_to_save) beside one without."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from loraplex.protocol.adapters.adapter_config import parse_adapter_config
from loraplex.protocol.structs import AdapterOutcome, AdapterToLoad, ForwardBatch, ForwardReq
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.layers.attention import AttentionBackendError, select_attention_backend
from loraplex.worker.lora.layers import LoRALinear
from loraplex.worker.model.config import ModelConfigError
from loraplex.worker.model_runner import ModelRunner
from safetensors.torch import load_file, save_file

from tests.bert_models import build_bert_head_adapter, cross_encoder_scores, st_embeddings, words
from tests.lora_helpers import load_all, slot_loads, slot_of
from tests.worker_helpers import GREEDY, consecutive_pages, make_runner

FP32_TOL = 1e-4
MIN_ADAPTER_EFFECT = 1e-2
MIXED = [None, "a8", "a8", "a4", None, "a4"]  # tests/bert_models.py's BERT_ADAPTERS
LENGTHS = [5, 9, 3, 12, 1, 7]


def _runner(model_dir: Path, adapter_dirs: dict[str, Path]) -> ModelRunner:
    runner = make_runner(model_dir, enable_lora=True, max_lora_rank=8, lora_target_modules=["all"],
                         max_loras_per_batch=2)  # fmt: skip
    load_all(runner, adapter_dirs)
    return runner


@pytest.fixture(scope="module")
def embedder_runner(bert_embedder: tuple[Path, dict[str, Path]]) -> ModelRunner:
    return _runner(*bert_embedder)


def _pooled(runner: ModelRunner, encodings: list[dict[str, list[int]]], names: list[str | None]) -> torch.Tensor:
    """One pass of whole sequences, each pooled: (seqs, out) float32."""
    ids = [e["input_ids"] for e in encodings]
    pages = consecutive_pages([len(i) for i in ids], runner.page_size)
    reqs = [ForwardReq(input_ids=i, num_cached_tokens=0, page_ids=p, sampling=GREEDY, slot=slot_of(n), pool=True,
                       token_type_ids=e.get("token_type_ids", []))
            for i, p, n, e in zip(ids, pages, names, encodings, strict=True)]  # fmt: skip
    result = runner.step(ForwardBatch(batch_id=0, reqs=reqs, slot_loads=slot_loads(names)))
    return torch.from_numpy(np.stack([np.frombuffer(row, dtype="<f4") for row in result.pooled]))


def _by_adapter(names: list[str | None], reference) -> torch.Tensor:
    """The reference's rows for a mixed batch: each adapter's (and the base's) rows from one call of it."""
    out: dict[int, torch.Tensor] = {}
    for name in dict.fromkeys(names):
        rows = [i for i, n in enumerate(names) if n == name]
        for i, value in zip(rows, reference(rows, name), strict=True):
            out[i] = value
    return torch.stack([out[i] for i in range(len(names))])


def test_encoder_layers_carry_lora(embedder_runner: ModelRunner) -> None:
    runner = embedder_runner
    layer = runner.model.model.layers[0]
    assert all(isinstance(m, LoRALinear) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                   layer.mlp.up_proj, layer.mlp.down_proj))  # fmt: skip
    assert runner.attention.name == "torch"  # non-causal attention: the SDPA backends


def test_embeddings_match_sentence_transformers(bert_embedder: tuple[Path, dict[str, Path]],
                                                embedder_runner: ModelRunner) -> None:  # fmt: skip
    from transformers import AutoTokenizer

    model_dir, adapter_dirs = bert_embedder
    runner = embedder_runner
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [words(n, seed) for seed, n in enumerate(LENGTHS)]
    ours = _pooled(runner, [tokenizer(t) for t in texts], MIXED)

    def reference(rows: list[int], name: str | None) -> torch.Tensor:
        return st_embeddings(model_dir, [texts[i] for i in rows], adapter_dirs[name] if name else None)

    ref = _by_adapter(MIXED, reference)
    assert ours.shape == ref.shape == (len(texts), 64)
    cosines = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    assert (1 - cosines).max().item() < FP32_TOL, cosines
    torch.testing.assert_close(ours, ref, atol=FP32_TOL, rtol=0)
    base = st_embeddings(model_dir, texts)
    effect = (ref - base).abs().amax(dim=-1)
    assert all(effect[i] > MIN_ADAPTER_EFFECT for i, n in enumerate(MIXED) if n is not None)


def test_cross_encoder_scores_match_sentence_transformers(bert_cross_encoder: tuple[Path, dict[str, Path]]) -> None:
    from transformers import AutoTokenizer

    model_dir, adapter_dirs = bert_cross_encoder
    runner = _runner(model_dir, adapter_dirs)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs = [(words(3, seed), words(n, seed + 50)) for seed, n in enumerate(LENGTHS)]
    encodings = [tokenizer(query, document) for query, document in pairs]
    assert all(1 in e["token_type_ids"] for e in encodings)  # the document's segment is read
    ours = torch.sigmoid(_pooled(runner, encodings, MIXED))  # the one label's logit -> relevance

    def reference(rows: list[int], name: str | None) -> torch.Tensor:
        return cross_encoder_scores(model_dir, [pairs[i] for i in rows], adapter_dirs[name] if name else None)

    ref = _by_adapter(MIXED, reference)
    assert ours.shape == ref.shape == (len(pairs), 1)
    torch.testing.assert_close(ours, ref, atol=FP32_TOL, rtol=0)
    base = cross_encoder_scores(model_dir, pairs)
    assert all((ref[i] - base[i]).abs().item() > MIN_ADAPTER_EFFECT / 10 for i, n in enumerate(MIXED) if n)


def test_cross_encoder_adapter_with_its_own_classifier(bert_cross_encoder: tuple[Path, dict[str, Path]],
                                                      embedder_runner: ModelRunner,
                                                      tmp_path: Path) -> None:  # fmt: skip
    # A PEFT SEQ_CLS adapter: LoRA, and its own classifier and pooler.dense (weights and biases), each row's head
    # the one of its adapter; beside it a4 (LoRA only) and the base, in one batch.
    from transformers import AutoTokenizer

    model_dir, adapter_dirs = bert_cross_encoder
    head_dir = tmp_path / "head"
    build_bert_head_adapter(model_dir, head_dir, seed=11)
    dirs = {"a4": adapter_dirs["a4"], "a8": head_dir}  # the head adapter in a8's id and slot
    runner = _runner(model_dir, dirs)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs = [(words(4, seed), words(n, seed + 70)) for seed, n in enumerate(LENGTHS)]
    ours = torch.sigmoid(_pooled(runner, [tokenizer(q, d) for q, d in pairs], MIXED))

    def reference(rows: list[int], name: str | None) -> torch.Tensor:
        return cross_encoder_scores(model_dir, [pairs[i] for i in rows], dirs[name] if name else None)

    ref = _by_adapter(MIXED, reference)
    torch.testing.assert_close(ours, ref, atol=FP32_TOL, rtol=0)
    # the head's copies are what moved the scores: the same LoRA under the base's head scores otherwise
    config = json.loads((head_dir / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["pooler.dense", "classifier", "score"]  # as PEFT 0.21 writes it
    lora_only = tmp_path / "lora_only"
    shutil.copytree(head_dir, lora_only)
    tensors = load_file(head_dir / "adapter_model.safetensors")
    save_file({k: t for k, t in tensors.items() if ".lora_" in k}, lora_only / "adapter_model.safetensors")
    (lora_only / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": None}))
    head_rows = [i for i, n in enumerate(MIXED) if n == "a8"]
    without = cross_encoder_scores(model_dir, [pairs[i] for i in head_rows], lora_only)
    assert (without - ref[head_rows]).abs().min().item() > MIN_ADAPTER_EFFECT
    # a head copy on a server with no classifier, and LoRA on the head, are refused by name
    on_embedder = runner_load(embedder_runner, head_dir)
    assert "runs no classifier" in on_embedder.error_message, on_embedder.error_message
    head_lora = tmp_path / "head_lora"
    build_bert_head_adapter(model_dir, head_lora, seed=12, target_modules=("query", "dense"), head=())
    refused = runner_load(runner, head_lora)
    assert refused.error_kind == "invalid"
    assert "LoRA on the classifier's pooler.dense is not supported" in refused.error_message, refused.error_message


def runner_load(runner: ModelRunner, adapter_dir: Path) -> AdapterOutcome:
    """One more adapter's load (a new id), expected to be refused."""
    outcome = runner.lora.load([AdapterToLoad(lora_name="extra", lora_path=str(adapter_dir), lora_id=90)])[0]
    assert not outcome.success
    return outcome


def test_encoder_refuses_a_sequence_in_parts(embedder_runner: ModelRunner) -> None:
    runner = embedder_runner
    req = ForwardReq(input_ids=[2, 7, 3], num_cached_tokens=4, page_ids=[0, 1], sampling=GREEDY, pool=True)
    with pytest.raises(BatchError, match="bidirectional encoder computes a sequence whole"):
        runner.step(ForwardBatch(batch_id=0, reqs=[req]))
    bad_types = ForwardReq(input_ids=[2, 7, 3], num_cached_tokens=0, page_ids=[0], sampling=GREEDY, pool=True,
                           token_type_ids=[0, 1, 2])  # fmt: skip
    with pytest.raises(BatchError, match="token types outside 0..1"):
        runner.step(ForwardBatch(batch_id=0, reqs=[bad_types]))


def test_encoder_without_pooling_is_refused(bert_embedder: tuple[Path, dict[str, Path]]) -> None:
    # the BertModel checkpoint without sentence-transformers' modules: nothing says it pools, so generate is refused
    with pytest.raises(ModelConfigError, match="bidirectional encoder.*--runner pooling"):
        make_runner(bert_embedder[0].parent / "hf")


def test_adapter_config_reads_bert_module_names() -> None:
    config = parse_adapter_config({"r": 4, "lora_alpha": 8, "target_modules": ["query", "value", "dense"]})
    assert config.target_modules == ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
    config = parse_adapter_config({"r": 4, "lora_alpha": 8, "target_modules": ["key", "output.dense"]})
    assert config.target_modules == ("k_proj", "o_proj", "down_proj")


def test_attention_backends_of_an_encoder() -> None:
    # the Triton kernels are causal: refused at start for an encoder, which auto runs on SDPA (CUDA included)
    with pytest.raises(AttentionBackendError, match="causal"):
        select_attention_backend("triton", "cpu", 4, 4, 16, bidirectional=True)
    assert select_attention_backend("auto", "cpu", 4, 4, 16, bidirectional=True).name == "torch"
