"""Model names compared for the base-model check, on plain strings: is the base an adapter was trained for the
served model (`SAME`), another model for certain (`DIFFERENT`), or can the names not tell (`UNSURE`)?

Names come from people and re-uploaders, so only what a name says for certain counts. Two names are the SAME when
their last components agree once case, separators and the words a quantized or converted checkpoint adds (AWQ, GPTQ,
bnb-4bit, FP8, hf, ...) are set aside. They are DIFFERENT only when both are Hub ids (`org/name`) that each name a
family with a version or a size, and differ in family, version or size (`Llama-3.1-8B` / `Llama-3.2-1B`, `Qwen2.5-7B`
/ `Qwen3-8B`, `Llama-2-7b` / `Llama-2-13b`). Everything else is UNSURE: a re-uploader's spelling
(`unsloth/llama-3-8b-Instruct-bnb-4bit` for `meta-llama/Meta-Llama-3-8B-Instruct`), a base and its Instruct or chat
variant (an adapter trained on the base is usually meant for the Instruct model too), a local path."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass


class BaseMatch(enum.Enum):
    DIFFERENT = 0
    UNSURE = 1
    SAME = 2


# Words a quantized or converted checkpoint's name adds to its base's (`Llama-3.1-8B-Instruct-AWQ-INT4`,
# `Qwen3-8B-FP8-dynamic`, `...-quantized.w4a16`, `llama-3-8b-bnb-4bit`, `Llama-2-7b-hf`).
_FORMAT_WORDS = frozenset({
    "awq", "gptq", "fp8", "fp16", "bf16", "fp32", "fp4", "nvfp4", "mxfp4", "int4", "int8", "w4a16", "w8a16", "w8a8",
    "w4a8", "dynamic", "quantized", "bnb", "4bit", "8bit", "nf4", "marlin", "gemm", "compressed", "hf", "gguf", "mlx",
    "exl2", "hqq"})
# A variant of the same weights' family: not a difference that refuses.
_VARIANT_WORDS = frozenset({"instruct", "chat", "it", "base"})
# A re-uploader's prefix before the family word (`Meta-Llama-3-8B` is `llama-3-8b`).
_PREFIX_WORDS = frozenset({"meta"})
# Separators: `-`, `_`, spaces, and a dot that is not inside a number (`quantized.w4a16`, but `3.1`, `1.5b`).
_SEPARATOR = re.compile(r"[-_\s]+|(?<!\d)\.|\.(?!\d)")
_SIZE = re.compile(r"(\d+x)?\d+(\.\d+)?[bm]")  # 8b, 1.5b, 135m, 8x7b
_VERSION = re.compile(r"v?(\d+(?:\.\d+)*)")  # 3, 3.1, v0.2
_GLUED = re.compile(r"([a-z]+)(\d+(?:\.\d+)*)")  # qwen2.5, llama3, phi3
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def is_hub_id(name: str) -> bool:
    return _HUB_ID.fullmatch(name) is not None


def _words(name: str) -> list[str]:
    """The last component's words, lowercased, without format words (unless nothing else is left)."""
    last = name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()
    words = [word for word in _SEPARATOR.split(last) if word]
    kept = [word for word in words if word not in _FORMAT_WORDS]
    return kept or words


@dataclass(frozen=True)
class _Parsed:
    family: str | None
    words: tuple[str, ...]  # glued numbers split off: `qwen2.5` -> `qwen`, `2.5`
    size: str | None

    @property
    def is_model_name(self) -> bool:  # a family with a version or a size, not `merged` or `my-finetune`
        return self.family is not None and (self.size is not None or self.version_after(self.family) is not None)

    def version_after(self, family: str) -> str | None:
        """The version of `family` in this name: the number after its word, else a `v0.2` word anywhere."""
        words = self.words
        if family in words:
            following = words.index(family) + 1
            if following < len(words) and _VERSION.fullmatch(words[following]):
                return _canonical_version(words[following])
        return next((_canonical_version(w) for w in words if w.startswith("v") and _VERSION.fullmatch(w)), None)


def _canonical_version(word: str) -> str:
    parts = word.removeprefix("v").split(".")
    while len(parts) > 1 and parts[-1] == "0":
        parts.pop()
    return ".".join(parts)


def _parse(name: str) -> _Parsed:
    words: list[str] = []
    for word in _words(name):
        glued = _GLUED.fullmatch(word)
        if glued and not _SIZE.fullmatch(word) and not word.startswith("v"):
            words.extend(glued.groups())
        else:
            words.append(word)
    family = next((w for w in words if w.isalpha() and w not in _PREFIX_WORDS | _VARIANT_WORDS), None)
    size = next((w for w in words if _SIZE.fullmatch(w)), None)
    return _Parsed(family, tuple(words), size)


def _key(name: str) -> str:
    return "".join(_words(name))


def _clearly_differ(a: _Parsed, b: _Parsed) -> bool:
    if not (a.is_model_name and b.is_model_name):
        return False
    # the family word both names contain (`Hermes-3-Llama-3.1-8B` contains `Llama-3.1-8B`'s `llama`)
    anchor = a.family if a.family in b.words else b.family if b.family in a.words else None
    if anchor is None:
        return True  # another family
    versions = a.version_after(anchor), b.version_after(anchor)
    differ_in_version = None not in versions and versions[0] != versions[1]
    return differ_in_version or (a.size is not None and b.size is not None and a.size != b.size)


def compare_names(base: str, served: str) -> BaseMatch:
    """One name of the served model against an adapter's base_model_name_or_path."""
    if _key(base) == _key(served):
        return BaseMatch.SAME
    if is_hub_id(base) and is_hub_id(served) and _clearly_differ(_parse(base), _parse(served)):
        return BaseMatch.DIFFERENT
    return BaseMatch.UNSURE


def match_base(base: str, served_names: Iterable[str]) -> BaseMatch:
    """An adapter's base against every name the served model is known by: the same as any of them, or another model
    for certain when every Hub id among them says so (a local name alone never refuses)."""
    verdicts = {name: compare_names(base, name) for name in served_names}
    if BaseMatch.SAME in verdicts.values():
        return BaseMatch.SAME
    hub_verdicts = [verdict for name, verdict in verdicts.items() if is_hub_id(name)]
    if hub_verdicts and all(verdict is BaseMatch.DIFFERENT for verdict in hub_verdicts):
        return BaseMatch.DIFFERENT
    return BaseMatch.UNSURE
