"""An adapter's own tokenizer: a directory that carries tokenizer files (added special tokens, a chat template, as
LlamaFactory and unsloth save them beside the adapter) is encoded, rendered, stopped and decoded with them for that
adapter's requests; every other request keeps the base model's.

A Vocabulary is what a request is tokenized with; the base model's is the Runtime's, an adapter's rides on its
registry entry (frontend/adapters/registry.py), so it goes when the entry goes (unload, in-place reload). The
workers know nothing of it: an added token is a row of the base model's embedding that the adapter trained (its
embed_tokens copy or trainable tokens), so the adapter's vocabulary must fit inside the base model's embedding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from loraplex.frontend.adapters.registry import AdapterError, _is_inside

# Any of these in an adapter's directory means it carries a tokenizer of its own (PEFT's save_pretrained writes none).
OWN_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class Vocabulary:
    """The tokenizer a request's text is encoded and decoded with, the chat template its messages go through (None:
    the tokenizer's own), and the tokens that end its output unless ignore_eos."""

    tokenizer: Any
    chat_template: str | None
    eos_token_ids: list[int]


class AdapterTokenizers:
    """Reads adapters' own tokenizers against the base model's vocabulary and embedding size (known once the server
    is up: the Runtime builds this then)."""

    def __init__(self, base: Vocabulary, embedding_rows: int):
        self.base = base
        self.embedding_rows = embedding_rows  # the base model's vocab_size: rows of embed_tokens and lm_head

    def read(self, name: str, path: str, root: str | None = None) -> Vocabulary | None:
        """The vocabulary of the adapter at `path` (a local directory, checked), or None when it carries no
        tokenizer; an AdapterError (400) when its tokenizer cannot be read, lies outside `root` or does not fit the
        base model's embedding. Blocking: call it off the event loop."""
        if not any(os.path.isfile(os.path.join(path, f)) for f in OWN_TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer

        try:
            if root is not None:  # the workers check the weights' files; these are read here
                for entry in os.scandir(path):
                    if not _is_inside(os.path.realpath(entry.path), root):
                        raise AdapterError(f"adapter {name!r}: file {entry.name!r} lies outside the allowed root",
                                           "forbidden")  # fmt: skip
            tokenizer = AutoTokenizer.from_pretrained(path)
        except AdapterError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to read the files is the adapter's fault
            raise AdapterError(f"adapter {name!r}: its tokenizer files cannot be read: {e}", "invalid") from e
        num_tokens = len(tokenizer)
        if num_tokens > self.embedding_rows:
            raise AdapterError(
                f"adapter {name!r}: its tokenizer has {num_tokens} tokens, more than the base model's embedding holds "
                f"({self.embedding_rows} rows): added tokens must be rows the base model has (resized vocabularies "
                "are not supported)", "invalid")  # fmt: skip
        base_template = self.base.chat_template or getattr(self.base.tokenizer, "chat_template", None)
        eos = set(self.base.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        # its own template when it has one (an adapter trained on a new template needs it), else the base model's
        return Vocabulary(tokenizer, getattr(tokenizer, "chat_template", None) or base_template, sorted(eos))
