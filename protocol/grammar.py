"""What an OutputConstraint means: the one mapping from its kind to xgrammar's compile call, shared by the frontend
(which checks a constraint before admitting the request) and the sampling worker (which masks with it), so the two
agree on every source. xgrammar is imported on first use: the scheduler never pays for it."""

from __future__ import annotations

import functools
import json
from typing import Any

from loraplex.protocol.structs import OutputConstraint

# A compiled grammar's token masks are cached by the compiler for reuse, least recently used dropped past this.
COMPILE_CACHE_BYTES = 256 << 20


@functools.cache
def xgrammar_import_error() -> str:
    """"" when xgrammar imports, else why not (say "ModuleNotFoundError: No module named 'tvm_ffi'": its dependencies
    are packages of their own, which an environment may lack). Tried once per process."""
    try:
        import xgrammar  # noqa: F401
    except Exception as e:  # noqa: BLE001 - an ImportError, or an OSError from its shared library
        return f"{type(e).__name__}: {e}"
    return ""


def unavailable_message(reason: str) -> str:
    """What a structured-output request is answered (501) when xgrammar cannot be imported where it is needed."""
    return f"structured output is unavailable on this server: xgrammar cannot be imported ({reason})"


def make_compiler(tokenizer: Any, vocab_size: int) -> Any:
    """An xgrammar GrammarCompiler over a Hugging Face tokenizer, its masks as wide as the model's logits (which may
    pad the tokenizer's vocabulary; padding ids are never allowed)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    return xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILE_CACHE_BYTES)


def json_schema_grammar(schema: str) -> str:
    """A JSON schema as xgrammar's EBNF. Whitespace as json.dumps writes it (", " and ": "): a model cannot loop on
    blanks. xgrammar 0.2.8 lets a length-bounded string (minLength / maxLength) hold raw control characters, which
    JSON forbids (json.loads refuses them): its character class gets the exclusion every other string rule has."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)


_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"


def compile_constraint(compiler: Any, constraint: OutputConstraint) -> Any:
    """The constraint's xgrammar CompiledGrammar; raises (RuntimeError from xgrammar) when the source is invalid."""
    if constraint.kind == "json_schema":
        return compiler.compile_grammar(json_schema_grammar(constraint.source))
    if constraint.kind == "regex":
        return compiler.compile_regex(constraint.source)
    if constraint.kind == "ebnf":
        return compiler.compile_grammar(constraint.source)
    if constraint.kind == "structural_tag":
        return compile_structural_tag(compiler, constraint.source)
    raise ValueError(f"unknown constraint kind {constraint.kind!r}")


def compile_structural_tag(compiler: Any, source: str) -> Any:
    """xgrammar's structural tag (JSON text): `{"type": "structural_tag", "format": ...}`, or the older form SGLang and
    vLLM still take, `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}` (free text until a trigger,
    then a tag whose content follows its schema)."""
    import xgrammar as xgr

    tag = json.loads(source)
    if not isinstance(tag, dict) or "structures" not in tag:
        return compiler.compile_structural_tag(source)
    try:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]  # fmt: skip
        triggers = list(tag["triggers"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"each of `structures` needs begin, schema and end, with `triggers` beside: {e!r}") from e
    return compiler.compile_structural_tag(items, triggers)
