"""AdapterTokenizers.read: an adapter directory's own tokenizer, or why not (the server test,
tests/server/test_adapter_tokenizers.py, serves one against peft)."""

from __future__ import annotations

from pathlib import Path

import pytest
from loraplex.frontend.adapters.registry import AdapterError
from loraplex.frontend.adapters.tokenizers import AdapterTokenizers, Vocabulary

from tests.builders import CHAT_TEMPLATE, build_tokenizer, make_tokenizer, tokenizer_vocab_size

BASE_EOS = [2, 4]


@pytest.fixture(scope="module")
def tokenizers() -> AdapterTokenizers:
    return AdapterTokenizers(Vocabulary(make_tokenizer(), None, BASE_EOS), embedding_rows=tokenizer_vocab_size() + 2)


def test_a_directory_without_tokenizer_files_has_none(tokenizers: AdapterTokenizers, tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    assert tokenizers.read("a", str(tmp_path)) is None


def test_an_added_end_token_joins_the_base_ones(tokenizers: AdapterTokenizers, tmp_path: Path) -> None:
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"eos_token": "<|end|>"})
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    vocabulary = tokenizers.read("a", str(tmp_path), root=str(tmp_path))
    assert vocabulary.eos_token_ids == [*BASE_EOS, tokenizer_vocab_size()]
    assert vocabulary.chat_template == CHAT_TEMPLATE  # none of its own: the base model's


@pytest.mark.parametrize("case", ["too_large", "unreadable", "outside_root"])
def test_refusals_name_their_cause(tokenizers: AdapterTokenizers, tmp_path: Path, case: str) -> None:
    adapter, root = tmp_path / "root" / "a", tmp_path / "root"
    build_tokenizer(adapter)
    if case == "too_large":
        tokenizer = make_tokenizer()
        tokenizer.add_tokens(["<x1>", "<x2>", "<x3>"])
        tokenizer.save_pretrained(adapter)
    elif case == "unreadable":
        (adapter / "tokenizer.json").write_text("{not json")
    else:
        (tmp_path / "elsewhere.json").write_text("{}")
        (adapter / "chat_template.jinja").unlink(missing_ok=True)
        (adapter / "chat_template.jinja").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(AdapterError) as refused:
        tokenizers.read("a", str(adapter), root=str(root))
    expected = {"too_large": ("1003 tokens", "1002 rows"), "unreadable": ("cannot be read",),
                "outside_root": ("chat_template.jinja", "outside")}[case]  # fmt: skip
    assert all(words in str(refused.value) for words in expected), str(refused.value)
    assert refused.value.kind == ("forbidden" if case == "outside_root" else "invalid")
