"""Tiny pooling checkpoints and their references (no tests here): a sentence-transformers embedder (Qwen3, last
token, normalised), a Qwen3 reranker scored by its yes/no logits, a `Qwen3ForSequenceClassification`; adapters with
the score head as a full module; a pooled pass of the base and two adapters; and sentence-transformers / HF (+ PEFT)
outputs to compare with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, SamplingParams, SlotLoad
from loraplex.worker.model_runner import ModelRunner
from safetensors.torch import load_file, save_file

from tests.builders import add_tokenizer_words, build_lora_adapter, build_tiny_model
from tests.worker_helpers import consecutive_pages

LABELS = ["negative", "neutral", "positive"]
# classifier_from_token of the reranker: both are one token of the test tokenizer
RERANKER_TOKENS = ["no", "yes"]
RERANKER_OVERRIDES = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": RERANKER_TOKENS}


def build_st_embedder(out_dir: Path, *, seed: int = 0, **shape) -> Path:
    """A sentence-transformers directory as Qwen3-Embedding ships one: the bare decoder (`Qwen3Model`, no `model.`
    prefix, no LM head), `modules.json`, `1_Pooling/config.json` (last token, the flags format) and Normalize; written
    here, so building it imports no sentence-transformers. Returns the causal-LM checkpoint it was made from (beside
    it): adapters are built on it, and PEFT runs it. `shape`: build_tiny_model's sizes (default: the tiny ones)."""
    causal = out_dir.parent / f"{out_dir.name}-causal"
    build_tiny_model(causal, arch="qwen3", seed=seed, **shape)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((causal / "config.json").read_text())
    config["architectures"] = ["Qwen3Model"]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(causal / "model.safetensors")
    bare = {name.removeprefix("model."): t for name, t in weights.items() if not name.startswith("lm_head.")}
    save_file(bare, out_dir / "model.safetensors", metadata={"format": "pt"})
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(causal / name, out_dir / name)
    # Plain texts, not chat messages (sentence-transformers renders a chat template where the tokenizer has one), and
    # a pad token for its batches.
    tokenizer_config = json.loads((causal / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    tokenizer_config["pad_token"] = tokenizer_config.get("eos_token", "<|endoftext|>")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (out_dir / "modules.json").write_text(json.dumps(modules, indent=2))
    (out_dir / "1_Pooling").mkdir(exist_ok=True)
    flags = {f"pooling_mode_{mode}": mode == "lasttoken" for mode in
             ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")}
    pooling = {"word_embedding_dimension": config["hidden_size"], **flags, "include_prompt": True}
    (out_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (out_dir / "2_Normalize").mkdir(exist_ok=True)
    (out_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))
    return causal


def build_classifier(out_dir: Path, *, seed: int = 0, arch: str = "qwen3") -> None:
    """A tiny Qwen3ForSequenceClassification (LlamaForSequenceClassification, ...) with len(LABELS) labels and a
    random score head."""
    from transformers import AutoModelForSequenceClassification

    build_tiny_model(out_dir, arch=arch, seed=seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        out_dir, num_labels=len(LABELS), id2label=dict(enumerate(LABELS)), label2id={n: i for i, n in enumerate(LABELS)}
    )
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=generator) * 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)


def build_reranker(out_dir: Path, *, seed: int = 0) -> None:
    """A tiny Qwen3 causal LM served as a reranker from its "yes"/"no" logits (RERANKER_OVERRIDES): the two words are
    added to the tokenizer, with random rows of their own."""
    from transformers import AutoModelForCausalLM

    build_tiny_model(out_dir, arch="qwen3", seed=seed)
    tokenizer = add_tokenizer_words(out_dir, RERANKER_TOKENS)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            weight[-len(RERANKER_TOKENS):] = torch.randn(len(RERANKER_TOKENS), weight.shape[1], generator=generator)
    model.save_pretrained(out_dir, safe_serialization=True)


def build_score_adapter(base_dir: Path, out_dir: Path, *, seed: int) -> None:
    """A LoRA adapter on every linear of the classifier, with its own score head (modules_to_save=["score"])."""
    build_lora_adapter(base_dir, out_dir, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                       seed=seed)  # fmt: skip
    config = json.loads((out_dir / "adapter_config.json").read_text())
    config.update(modules_to_save=["score"], task_type="SEQ_CLS")
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(out_dir / "adapter_model.safetensors")
    base = load_file(base_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(seed + 100)
    score = base["score.weight"]
    tensors["base_model.model.score.weight"] = score + torch.randn(score.shape, generator=generator) * 0.5
    save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})


def load_adapters(runner: ModelRunner, dirs: dict[str, Path]) -> None:
    specs = [AdapterToLoad(lora_id=i + 1, lora_name=name, lora_path=str(path)) for i, (name, path) in
             enumerate(dirs.items())]  # fmt: skip
    results = runner.lora.load(specs)
    assert all(r.success for r in results), [r.error_message for r in results]


def pool(runner: ModelRunner, prompts: list[list[int]], names: list[str | None]) -> torch.Tensor:
    """One pass over every prompt, each with its adapter ("a" in slot 0, "b" in slot 1): (prompts, out)."""
    slots = {None: -1, "a": 0, "b": 1}
    loads = [SlotLoad(slot=0, lora_id=1), SlotLoad(slot=1, lora_id=2)] if runner.lora is not None else []
    pages = consecutive_pages([len(p) for p in prompts], runner.page_size)
    reqs = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=SamplingParams(), pool=True,
                       slot=slots[name]) for p, pg, name in zip(prompts, pages, names, strict=True)]  # fmt: skip
    result = runner.step(ForwardBatch(batch_id=0, reqs=reqs, slot_loads=loads))
    assert len(result.pooled) == len(prompts) and all(result.pooled)
    return torch.tensor(np.stack([np.frombuffer(row, "<f4") for row in result.pooled]))


@torch.no_grad()
def peft_embeddings(causal_dir: Path, prompts: list[list[int]], adapter_dir: Path | None = None,
                    pooling_type: str = "last") -> torch.Tensor:
    """(prompts, hidden): HF's (+ PEFT's) decoder final (normed) states pooled as sentence-transformers pools them
    (the last token, the mean of all, the first), normalised."""
    from tests.reference import hf_model

    model = hf_model(str(causal_dir), str(adapter_dir) if adapter_dir else None)
    decoder = model.get_base_model().model if adapter_dir else model.model  # PEFT's LoRA layers sit in it
    rows = []
    for prompt in prompts:
        states = decoder(input_ids=torch.tensor([prompt])).last_hidden_state[0]  # (len, hidden)
        rows.append({"last": states[-1], "cls": states[0], "mean": states.mean(dim=0)}[pooling_type])
    return torch.nn.functional.normalize(torch.stack(rows).float(), dim=-1)


def st_embeddings(model_dir: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    return torch.as_tensor(model.encode(texts, convert_to_numpy=True, batch_size=1))


@torch.no_grad()
def hf_classify_logits(model_dir: Path, prompts: list[list[int]], adapter_dir: Path | None = None) -> torch.Tensor:
    """(prompts, labels): HF's (+ PEFT's) sequence-classification logits, one prompt at a time (last token)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    return torch.cat([model(input_ids=torch.tensor([p])).logits for p in prompts]).float()


@torch.no_grad()
def hf_yes_no_scores(model_dir: Path, prompts: list[list[int]], yes_id: int, no_id: int,
                     adapter_dir: Path | None = None) -> torch.Tensor:
    """(prompts,): Qwen3-Reranker's score, p(yes) of a softmax over the yes and no logits at the last position."""
    from tests.reference import hf_model

    model = hf_model(str(model_dir), str(adapter_dir) if adapter_dir else None)
    scores = []
    for prompt in prompts:
        last = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
        scores.append(torch.softmax(last[[no_id, yes_id]], dim=-1)[1])
    return torch.stack(scores)
