"""The base-model check: which adapters load silently, load with one warning, or are refused (400
base_model_mismatch), by what is known of the served model — under the default rule, --lora-strict-base-match and
--lora-allow-base-mismatch."""

from __future__ import annotations

import json
import logging

import pytest
from loraplex.frontend.adapters.base_names import BaseMatch, compare_names
from loraplex.frontend.adapters.integrity import AdapterIntegrity
from loraplex.frontend.entrypoints.cli import config_from_args
from loraplex.protocol.adapters.adapter_config import AdapterLoadError
from loraplex.protocol.config import ConfigError, ServerConfig
from loraplex.protocol.model_ref import parse_model_ref

LOAD, WARN, REFUSE = "load", "warn", "refuse"
SNAPSHOT = "/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/5206a32e0bd3067aef1ce90f5528ade7d866253f"

# (--model-path: a path starting with / is a local directory made under tmp_path, anything else is taken as given;
#  --served-model-name; the checkpoint's config.json `_name_or_path`; the adapter's base_model_name_or_path; outcome)
CASES = [
    # the served model known by its Hugging Face cache repo id, its --served-model-name, its config.json
    (SNAPSHOT, None, None, "meta-llama/Llama-3.1-8B-Instruct", LOAD),
    ("/models/x", "meta-llama/Llama-3.1-8B", None, "meta-llama/Llama-3.1-8B", LOAD),
    ("/models/llama3", None, "meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B", LOAD),
    # names that differ only in org, case, separators, quantization and format words
    ("/models/Llama-2-7B-GPTQ", None, None, "meta-llama/Llama-2-7b-hf", LOAD),
    ("hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4", None, None, "meta-llama/Meta-Llama-3.1-8B-Instruct", LOAD),
    ("/models/Qwen3-8B-FP8", None, None, "Qwen/qwen3_8b", LOAD),
    # names that cannot tell: a local path on either side, a re-uploader's spelling, a base on its Instruct model
    ("/models/llama3", None, None, "meta-llama/Meta-Llama-3-8B", WARN),
    ("/models/Meta-Llama-3-8B-Instruct", None, None, "unsloth/llama-3-8b-Instruct-bnb-4bit", WARN),
    ("meta-llama/Meta-Llama-3-8B-Instruct", None, None, "unsloth/llama-3-8b-Instruct-bnb-4bit", WARN),
    ("meta-llama/Meta-Llama-3-8B-Instruct", None, None, "meta-llama/Meta-Llama-3-8B", WARN),
    ("/models/llama3", None, None, "/home/me/ckpt/base", WARN),
    ("meta-llama/Llama-3.1-8B", None, None, "/home/me/ckpt/base", WARN),
    ("meta-llama/Llama-3.1-8B", None, None, "./outputs/merged", WARN),
    ("/models/Qwen3-8B-FP8", None, None, "Qwen/Qwen3-4B", WARN),  # a local name alone never refuses
    ("/models/x", "tiny-chat", None, "meta-llama/Llama-3.1-8B", WARN),
    # two Hub models that differ in family, version or size
    ("meta-llama/Llama-3.1-8B", None, None, "meta-llama/Llama-3.2-1B", REFUSE),
    ("Qwen/Qwen2.5-7B", None, None, "Qwen/Qwen3-8B", REFUSE),
    ("meta-llama/Llama-2-7b-hf", None, None, "meta-llama/Llama-2-13b-hf", REFUSE),
    ("RedHatAI/Qwen3-8B-FP8-dynamic", None, None, "Qwen/Qwen3-4B", REFUSE),
    (SNAPSHOT, None, None, "meta-llama/Llama-3.2-1B-Instruct", REFUSE),
    ("/models/x", "meta-llama/Llama-3.1-8B", None, "Qwen/Qwen3-8B", REFUSE),
    ("/models/llama3", None, "meta-llama/Meta-Llama-3-8B", "Qwen/Qwen2.5-7B", REFUSE),
]
# The flags change what a mismatch does; a name the served model is known by always loads silently.
MODES = {
    "default": {},
    "strict": {"lora_strict_base_match": True},  # every mismatch of names refused
    "allow": {"lora_allow_base_mismatch": True},  # none refused
}


def expected_outcome(outcome: str, mode: str) -> str:
    if outcome == LOAD:
        return LOAD
    return {"default": outcome, "strict": REFUSE, "allow": WARN}[mode]


def served_config(tmp_path, model_path: str, served_name: str | None, own_name: str | None, **flags) -> ServerConfig:
    if model_path.startswith("/"):
        local = tmp_path / model_path.lstrip("/")
        local.mkdir(parents=True)
        if own_name:
            (local / "config.json").write_text(json.dumps({"_name_or_path": own_name, "model_type": "llama"}))
        model_path = str(local)
    return ServerConfig(model_path=model_path, served_model_name=served_name, **flags)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize(("model_path", "served_name", "own_name", "base", "outcome"), CASES)
def test_base_check_table(tmp_path, caplog, mode, model_path, served_name, own_name, base, outcome):
    config = served_config(tmp_path, model_path, served_name, own_name, **MODES[mode])
    integrity = AdapterIntegrity(config)
    expected = expected_outcome(outcome, mode)
    with caplog.at_level(logging.WARNING, logger="loraplex.adapters"):
        if expected == REFUSE:
            with pytest.raises(AdapterLoadError) as info:
                integrity.check_config("x", {"base_model_name_or_path": base})
            assert info.value.kind == "base_model_mismatch"
            assert base in str(info.value) and config.model_name in str(info.value)  # names both
        else:
            integrity.check_config("x", {"base_model_name_or_path": base})
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == (expected == WARN), warnings  # one line per warned load, none otherwise
    if expected == WARN:
        assert base in warnings[0] and config.model_name in warnings[0] and "base_model_mismatch" in warnings[0]


@pytest.mark.parametrize(("base", "served", "match"), [
    ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/llama_3.1_8b_instruct", BaseMatch.SAME),
    ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "Qwen2.5-7B-Instruct", BaseMatch.SAME),
    ("neuralmagic/Meta-Llama-3.1-8B-Instruct-quantized.w4a16", "Meta-Llama-3.1-8B-Instruct", BaseMatch.SAME),
    ("unsloth/llama-3-8b-Instruct-bnb-4bit", "meta-llama/Meta-Llama-3-8B-Instruct", BaseMatch.UNSURE),
    ("google/gemma-2-9b", "google/gemma-2-9b-it", BaseMatch.UNSURE),
    ("NousResearch/Hermes-3-Llama-3.1-8B", "meta-llama/Llama-3.1-8B", BaseMatch.UNSURE),  # names its family
    ("my-org/finetune", "meta-llama/Llama-3.1-8B", BaseMatch.UNSURE),  # no version or size: not a model name
    ("outputs/merged", "Qwen/Qwen3-8B", BaseMatch.UNSURE),
    ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3-8B", BaseMatch.DIFFERENT),  # version
    ("mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-Instruct-v0.2", BaseMatch.DIFFERENT),
    ("microsoft/Phi-3-mini-4k-instruct", "microsoft/Phi-3.5-mini-instruct", BaseMatch.DIFFERENT),
    ("mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x22B-v0.1", BaseMatch.DIFFERENT),  # size
    ("meta-llama/Llama-3.1-8B", "Qwen/Qwen3-8B", BaseMatch.DIFFERENT),  # family
    ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B-FP8", BaseMatch.SAME),
    ("FP8", "Qwen/Qwen3-8B-FP8", BaseMatch.UNSURE),  # a name of format words only is kept whole
])
def test_compare_names(base, served, match):
    assert compare_names(base, served) is match
    assert compare_names(served, base) is match  # symmetric


def test_a_cache_snapshot_is_known_by_its_repo_id():
    assert parse_model_ref(SNAPSHOT).repo_id == "meta-llama/Llama-3.1-8B-Instruct"
    assert parse_model_ref(SNAPSHOT + "/").repo_id == "meta-llama/Llama-3.1-8B-Instruct"
    assert parse_model_ref("/models/Llama-3.1-8B").repo_id is None


def test_strict_and_allow_contradict():
    assert config_from_args(["--lora-strict-base-match"]).lora_strict_base_match
    with pytest.raises(ConfigError, match="--lora-allow-base-mismatch and --lora-strict-base-match"):
        config_from_args(["--lora-strict-base-match", "--lora-allow-base-mismatch"])
