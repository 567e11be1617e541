"""Speculative decoding's settings: vLLM's --speculative-config JSON and SGLang's --speculative-* flags, read into one
SpeculativeConfig (validated once, inside the frozen ServerConfig)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class SpeculativeConfigError(ValueError):
    pass


# The methods that run; the others are named in the refusal.
SUPPORTED_METHODS = ("ngram", "draft_model", "eagle3")
# SGLang's --speculative-algorithm -> vLLM's method
SGLANG_ALGORITHMS = {"NGRAM": "ngram", "STANDALONE": "draft_model", "EAGLE3": "eagle3", "EAGLE": "eagle3"}
MAX_SPECULATIVE_TOKENS = 16  # a verify pass writes 1 + k tokens per request: bounded so a pass stays a decode step


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    method: Literal["ngram", "draft_model", "eagle3"]
    num_speculative_tokens: int  # k: draft tokens a request verifies per pass at most
    # ngram (prompt lookup): the longest suffix of the request's tokens, prompt_lookup_max down to prompt_lookup_min
    # tokens long, that occurred before; the tokens that followed it are the draft.
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # draft_model: a smaller model with the target's tokenizer; eagle3: the head's directory


def speculative_config(
    config_json: dict[str, Any],
    algorithm: str | None,
    draft_model_path: str | None,
    num_draft_tokens: int | None,
) -> SpeculativeConfig | None:
    """The one SpeculativeConfig of either spelling, None when speculation is off; SpeculativeConfigError naming the
    cause when the settings are bad or ask for a method that does not run."""
    sglang_given = algorithm is not None or draft_model_path is not None or num_draft_tokens is not None
    if config_json and sglang_given:
        raise SpeculativeConfigError("--speculative-config and --speculative-algorithm/--speculative-* are two "
                                     "spellings of one setting: give one")  # fmt: skip
    if sglang_given:
        if algorithm is None:
            raise SpeculativeConfigError("--speculative-draft-model-path / --speculative-num-draft-tokens need "
                                         "--speculative-algorithm NGRAM|STANDALONE|EAGLE3")  # fmt: skip
        method = SGLANG_ALGORITHMS.get(algorithm.upper())
        if method is None:
            raise SpeculativeConfigError(f"--speculative-algorithm {algorithm}: expected one of "
                                         f"{', '.join(SGLANG_ALGORITHMS)}")  # fmt: skip
        config_json = {"method": method, "num_speculative_tokens": num_draft_tokens or 4}
        if draft_model_path is not None:
            config_json["model"] = draft_model_path
    if not config_json:
        return None
    try:
        spec = msgspec.convert(config_json, SpeculativeConfig)
    except msgspec.ValidationError as e:
        given = msgspec.json.encode(config_json).decode()
        raise SpeculativeConfigError(f"bad --speculative-config {given}: {e}") from e
    _check(spec)
    return spec


def _check(spec: SpeculativeConfig) -> None:
    if not 1 <= spec.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise SpeculativeConfigError(f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got "
                                     f"{spec.num_speculative_tokens}")  # fmt: skip
    if spec.method != "ngram" and not spec.model:
        raise SpeculativeConfigError(f"speculative method {spec.method} needs `model` (--speculative-draft-model-path)")
    if spec.method == "ngram":
        if not 1 <= spec.prompt_lookup_min <= spec.prompt_lookup_max:
            raise SpeculativeConfigError(f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                         f"{spec.prompt_lookup_min} and {spec.prompt_lookup_max}")  # fmt: skip
        if spec.model:
            raise SpeculativeConfigError("ngram drafts from the request's own tokens: it takes no `model`")
    if spec.method not in SUPPORTED_METHODS:
        raise SpeculativeConfigError(f"speculative method {spec.method} is not supported yet (supported: "
                                     f"{', '.join(SUPPORTED_METHODS)})")  # fmt: skip
