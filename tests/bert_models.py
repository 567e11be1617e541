"""Tiny BERT checkpoints built here (nothing from a hub): a sentence-transformers embedder (BertModel with its
Pooling and Normalize modules), a cross-encoder (BertForSequenceClassification, one label), a WordPiece tokenizer
of made-up words, PEFT adapters on BERT's module names, and the references they are compared against:
sentence-transformers' SentenceTransformer and CrossEncoder, each with its adapter through peft."""

from __future__ import annotations

import random
from pathlib import Path

import torch

TINY_BERT = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                 max_position_embeddings=64, type_vocab_size=2)  # fmt: skip
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# every linear of an encoder layer, as PEFT names BERT's modules
BERT_TARGETS = ("query", "key", "value", "attention.output.dense", "intermediate.dense", "output.dense")


def words(count: int, seed: int) -> str:
    """A text of `count` of the tokenizer's words (each one token)."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(TINY_BERT['vocab_size'] - len(SPECIAL_TOKENS))}" for _ in range(count))


def _save_tokenizer(out_dir: Path) -> None:
    from transformers import BertTokenizerFast

    num_words = TINY_BERT["vocab_size"] - len(SPECIAL_TOKENS)
    vocab = out_dir / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL_TOKENS + [f"w{i}" for i in range(num_words)]) + "\n")
    BertTokenizerFast(str(vocab), do_lower_case=True).save_pretrained(out_dir)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight random and non-zero (LayerNorms near one), so each is observable in the outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.2 * noise if name.endswith("LayerNorm.weight") else 0.2 * noise)


def build_bert_embedder(out_dir: Path, *, pooling: str = "mean", normalize: bool = True, seed: int = 0) -> None:
    """A sentence-transformers model: BertModel, Pooling(`pooling`), and Normalize if `normalize`."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel

    hf_dir = out_dir / "hf"
    hf_dir.mkdir(parents=True)
    model = BertModel(BertConfig(**TINY_BERT))
    _randomize(model, seed)
    model.save_pretrained(hf_dir)
    _save_tokenizer(hf_dir)
    modules = [models.Transformer(str(hf_dir)), models.Pooling(TINY_BERT["hidden_size"], pooling)]
    SentenceTransformer(modules=modules + ([models.Normalize()] if normalize else []), device="cpu").save(
        str(out_dir / "st")
    )


def build_bert_cross_encoder(out_dir: Path, *, seed: int = 1) -> None:
    """BertForSequenceClassification with one label (a relevance score), as CrossEncoder loads it."""
    from transformers import BertConfig, BertForSequenceClassification

    model = BertForSequenceClassification(BertConfig(**TINY_BERT, num_labels=1))
    _randomize(model, seed)
    model.save_pretrained(out_dir)
    _save_tokenizer(out_dir)


def build_bert_adapter(base_dir: Path, out_dir: Path, *, r: int, lora_alpha: float, target_modules: tuple[str, ...],
                       seed: int) -> None:  # fmt: skip
    """A PEFT LoRA adapter on the BERT checkpoint at base_dir (its own class), A and B random."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, BertForSequenceClassification, BertModel

    from tests.lora_helpers import randomize_adapter

    is_classifier = "BertForSequenceClassification" in (AutoConfig.from_pretrained(base_dir).architectures or [])
    model = (BertForSequenceClassification if is_classifier else BertModel).from_pretrained(base_dir)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules),
                                                  lora_dropout=0.0))  # fmt: skip
    randomize_adapter(peft_model, seed, lora_std=0.2)
    peft_model.save_pretrained(out_dir)


HEAD_ADAPTER_TARGETS = ("query", "value", "intermediate.dense")


def build_bert_head_adapter(base_dir: Path, out_dir: Path, *, seed: int,
                            target_modules: tuple[str, ...] = HEAD_ADAPTER_TARGETS,
                            head: tuple[str, ...] = ("pooler.dense",)) -> None:  # fmt: skip
    """A PEFT SEQ_CLS adapter on the cross-encoder at base_dir, as PEFT trains one: LoRA on `target_modules`, and its
    own classifier (SEQ_CLS puts "classifier" and "score" in modules_to_save) and the modules of `head` (PEFT saves
    each copy's weight and bias); LoRA random, the copies the base's plus noise."""
    from peft import LoraConfig, get_peft_model
    from transformers import BertForSequenceClassification

    from tests.lora_helpers import randomize_adapter

    model = BertForSequenceClassification.from_pretrained(base_dir)
    config = LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=list(target_modules), lora_dropout=0.0,
                        modules_to_save=list(head) or None)  # fmt: skip
    peft_model = get_peft_model(model, config)
    randomize_adapter(peft_model, seed, lora_std=0.2)
    peft_model.save_pretrained(out_dir)


# the adapters the tests share: every linear at rank 8; query and value only at rank 4
BERT_ADAPTERS = {"a8": (8, 16, BERT_TARGETS), "a4": (4, 16, ("query", "value"))}


def build_bert_adapters(base_dir: Path, root: Path) -> dict[str, Path]:
    """BERT_ADAPTERS on the checkpoint at base_dir, under root/<name>."""
    for seed, (name, (r, alpha, targets)) in enumerate(BERT_ADAPTERS.items(), start=3):
        build_bert_adapter(base_dir, root / name, r=r, lora_alpha=alpha, target_modules=targets, seed=seed)
    return {name: root / name for name in BERT_ADAPTERS}


def st_embeddings(st_dir: Path, texts: list[str], adapter_dir: Path | None = None) -> torch.Tensor:
    """sentence-transformers' embeddings of `texts` (the adapter through peft on its transformer)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(st_dir), device="cpu")
    if adapter_dir is not None:
        model.load_adapter(str(adapter_dir))
    return model.encode(texts, convert_to_tensor=True, batch_size=len(texts)).float()


def cross_encoder_scores(model_dir: Path, pairs: list[tuple[str, str]], adapter_dir: Path | None = None
                         ) -> torch.Tensor:  # fmt: skip
    """sentence-transformers' CrossEncoder scores (sigmoid of the one label) of (query, document) pairs."""
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(model_dir), device="cpu")
    if adapter_dir is not None:
        model.load_adapter(str(adapter_dir))
    return torch.as_tensor(model.predict(pairs, batch_size=len(pairs))).float().reshape(len(pairs), -1)
