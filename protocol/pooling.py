"""PoolingSpec: what a pooling server computes per request, resolved once from the launch flags and the checkpoint.

Every process resolves it alike from (ServerConfig, model dir): the frontend picks the routes and the prompt format,
the scheduler runs prefill-only requests, the workers build the pooler and the head (worker/pooling.py).

The runner is `pooling` when a flag asks for it (--runner pooling, --convert, --task other than generate,
--is-embedding) or, with --runner auto, when the checkpoint is one: a `*ForSequenceClassification` architecture, or a
sentence-transformers directory (`modules.json` with a Pooling module). The task then is `classify` for a
classification checkpoint or one converted from the LM head's token logits (config `classifier_from_token`, vLLM's:
Qwen3-Reranker's ["no", "yes"]), else `embed`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec
from loraplex.protocol.config import ConfigError, ServerConfig

# sentence-transformers' Pooling config: `pooling_mode` (its version 5 on) -> our pooling type; before, flags
_ST_POOLING_MODE = {"cls": "cls", "lasttoken": "last", "mean": "mean"}
_ST_POOLING_FLAGS = (("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "last"),
                     ("pooling_mode_mean_tokens", "mean"))  # fmt: skip
# Encoder families pool their first token where the checkpoint names no pooling (a BERT classifier's [CLS] head);
# decoders their last, the only one that has read the whole text.
FIRST_TOKEN_MODEL_TYPES = {"bert", "modernbert", "roberta", "xlm-roberta"}
# Families whose attention reads both ways: a prompt runs whole in one pass from position 0 (no chunks, no cached
# prefix), as every token's state depends on the tokens after it.
BIDIRECTIONAL_MODEL_TYPES = {"bert", "modernbert", "roberta", "xlm-roberta"}

QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class PoolingSpec(msgspec.Struct, frozen=True, kw_only=True):
    task: str  # "embed" (a vector per input) or "classify" (a score per label; rerank and score read label 0)
    pooling_type: str  # "last", "mean" or "cls": which token states make the pooled one
    normalize: bool  # embed: the vector is scaled to unit length
    # classify: "score" (the checkpoint's `score` linear, hidden -> num_labels) or "tokens" (the LM head's logits of
    # head_token_ids; two of them make one label, their difference: p(second) of a softmax over the two)
    head: str = "none"
    head_token_ids: list[int] = []
    num_labels: int = 0
    labels: list[str] = []  # classify: each label's name (config id2label), else LABEL_i
    whole_prompt: bool = False  # a prompt runs in one pass from position 0: no chunked prefill, no cached prefix
    # "qwen3_reranker": a (query, document) pair is scored in Qwen3-Reranker's prompt; "": the tokenizer's pair
    pair_format: str = ""

    @property
    def activation(self) -> str:
        """How classify's logits become probabilities: one label -> sigmoid, several -> softmax."""
        return "sigmoid" if self.num_labels == 1 else "softmax"


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _st_pooling(model_dir: str) -> dict[str, Any] | None:
    """sentence-transformers' setup: {"pooling": its Pooling config, "normalize": bool}; None for a plain checkpoint."""
    modules_path = os.path.join(model_dir, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    modules = _read_json(modules_path)
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return None
    config_path = os.path.join(model_dir, pooling.get("path", ""), "config.json")
    config = _read_json(config_path) if os.path.isfile(config_path) else {}
    normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    return {"pooling": config, "normalize": normalize}


def _st_pooling_type(config: dict[str, Any], default: str) -> str:
    mode = config.get("pooling_mode")
    if isinstance(mode, str):
        if mode not in _ST_POOLING_MODE:
            raise ConfigError(f"sentence-transformers pooling_mode {mode!r} is not served (served: "
                              f"{', '.join(_ST_POOLING_MODE)})")  # fmt: skip
        return _ST_POOLING_MODE[mode]
    # the older flags: several set concatenate their poolings, which no served mode does; max or mean-sqrt-len alone
    # is not served either
    set_flags = sorted(key for key, value in config.items() if key.startswith("pooling_mode_") and value is True)
    served = dict(_ST_POOLING_FLAGS)
    if len(set_flags) > 1 or any(key not in served for key in set_flags):
        raise ConfigError(f"sentence-transformers pooling {', '.join(set_flags)} is not served (served: one of "
                          f"{', '.join(served)})")  # fmt: skip
    return served[set_flags[0]] if set_flags else default


def _token_ids(model_dir: str, tokens: list[Any]) -> list[int]:
    """classifier_from_token entries as ids: ints as they are, strings looked up in tokenizer.json's vocabulary."""
    if all(isinstance(t, int) for t in tokens):
        return list(tokens)
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConfigError(f"classifier_from_token {tokens} names tokens, but {model_dir} has no tokenizer.json")
    tok = _read_json(path)
    vocab = dict(tok.get("model", {}).get("vocab", {}))
    vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
    ids = []
    for token in tokens:
        if isinstance(token, int):
            ids.append(token)
        elif token in vocab:
            ids.append(int(vocab[token]))
        else:
            raise ConfigError(f"classifier_from_token: {token!r} is not one token of the vocabulary")
    return ids


def wants_pooling(config: ServerConfig) -> bool:
    return (config.runner == "pooling" or config.is_embedding or config.convert in ("embed", "classify")
            or config.task in ("embed", "score", "classify"))  # fmt: skip


def resolve_pooling(config: ServerConfig, model_dir: str) -> PoolingSpec | None:
    """The pooling server's spec, or None for the generate runner; ConfigError names a contradiction."""
    config_path = os.path.join(model_dir, "config.json")
    hf = _read_json(config_path) if os.path.isfile(config_path) else {}  # the workers name a missing one
    hf.update(config.hf_overrides)
    architectures = hf.get("architectures") or []
    is_classifier = any(str(a).endswith("ForSequenceClassification") for a in architectures)
    st = _st_pooling(model_dir)
    from_tokens = hf.get("classifier_from_token")
    asked = wants_pooling(config)
    if config.runner == "generate":
        if asked:
            raise ConfigError("--runner generate contradicts --convert/--task/--is-embedding (they ask for pooling)")
        return None
    if config.runner == "auto" and not (asked or is_classifier or st is not None):
        return None
    if config.convert == "embed" or config.task == "embed" or (config.is_embedding and config.task is None):
        task = "embed"
    elif config.convert == "classify" or config.task in ("score", "classify"):
        task = "classify"
    else:
        task = "classify" if is_classifier or from_tokens else "embed"
    model_type = str(hf.get("model_type", ""))
    text_type = str((hf.get("text_config") or {}).get("model_type", model_type))
    default_type = "cls" if text_type in FIRST_TOKEN_MODEL_TYPES else "last"
    pooling_type, normalize = default_type, True
    if st is not None:
        pooling_type = _st_pooling_type(st["pooling"], default_type)
        normalize = st["normalize"]
    whole = text_type in BIDIRECTIONAL_MODEL_TYPES or pooling_type != "last"
    if task == "embed":
        return PoolingSpec(task=task, pooling_type=pooling_type, normalize=normalize, whole_prompt=whole)
    if from_tokens:
        if not isinstance(from_tokens, list) or len(from_tokens) < 2:
            raise ConfigError(f"classifier_from_token must list two or more tokens, got {from_tokens!r}")
        ids = _token_ids(model_dir, from_tokens)
        num_labels = 1 if len(ids) == 2 else len(ids)
        labels = [str(from_tokens[-1])] if num_labels == 1 else [str(t) for t in from_tokens]
        is_qwen3 = model_type == "qwen3" and [str(t) for t in from_tokens] == ["no", "yes"]
        return PoolingSpec(task=task, pooling_type=default_type, normalize=False, head="tokens", head_token_ids=ids,
                           num_labels=num_labels, labels=labels, whole_prompt=whole,
                           pair_format="qwen3_reranker" if is_qwen3 else "")  # fmt: skip
    if not is_classifier:
        raise ConfigError("--convert classify needs a *ForSequenceClassification checkpoint (a `score` head) or "
                          "classifier_from_token in --hf-overrides (the LM head's token logits, vLLM's)")
    id2label = hf.get("id2label") or {}
    num_labels = int(hf.get("num_labels", len(id2label) or 2))
    labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels)]
    return PoolingSpec(task=task, pooling_type=default_type, normalize=False, head="score", num_labels=num_labels,
                       labels=labels, whole_prompt=whole)  # fmt: skip


def qwen3_reranker_prompt(query: str, document: str, instruction: str = QWEN3_RERANKER_INSTRUCTION) -> str:
    """Qwen3-Reranker's prompt for one pair: the model answers yes (relevant) or no."""
    return (f"{QWEN3_RERANKER_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
            f"{QWEN3_RERANKER_SUFFIX}")  # fmt: skip
