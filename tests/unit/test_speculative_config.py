"""Speculative decoding's settings: vLLM's JSON and SGLang's flags give one SpeculativeConfig; bad or unsupported
settings are refused at start with their cause."""

from __future__ import annotations

import pytest
from loraplex.frontend.entrypoints.cli import parse_command_line
from loraplex.protocol.config import ConfigError, ServerConfig
from loraplex.protocol.speculative import SpeculativeConfig


def test_vllm_json_and_sglang_flags_give_one_setting():
    vllm = ServerConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3})
    assert vllm.speculation == SpeculativeConfig(method="ngram", num_speculative_tokens=5, prompt_lookup_max=3)
    sglang = ServerConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    assert sglang.speculation == SpeculativeConfig(method="ngram", num_speculative_tokens=5)
    draft = ServerConfig(speculative_algorithm="STANDALONE", speculative_draft_model_path="/d")
    assert draft.speculation == SpeculativeConfig(method="draft_model", num_speculative_tokens=4, model="/d")
    eagle = ServerConfig(speculative_algorithm="EAGLE3", speculative_draft_model_path="/h")
    assert eagle.speculation == SpeculativeConfig(method="eagle3", num_speculative_tokens=4, model="/h")
    vllm_eagle = ServerConfig(speculative_config={"method": "eagle3", "num_speculative_tokens": 4, "model": "/h"})
    assert vllm_eagle.speculation == eagle.speculation
    assert ServerConfig().speculation is None


def test_the_command_line_takes_the_json():
    config, _ = parse_command_line(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert config.speculation.num_speculative_tokens == 2
    config, _ = parse_command_line(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "3"])
    assert config.speculation.num_speculative_tokens == 3


@pytest.mark.parametrize(("settings", "cause"), [
    ({"speculative_config": {"method": "eagle3", "num_speculative_tokens": 3}}, "eagle3 needs `model`"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/d",
      "speculative_lora_modules": ["x=/y", "x=/z"]}, "draft adapter name appears twice"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/d",
      "speculative_lora_modules": ["/y"]}, "expected NAME=PATH"),
    ({"speculative_config": {"method": "draft_model", "num_speculative_tokens": 3}}, "needs `model`"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}, "num_speculative_tokens"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
                             "prompt_lookup_max": 2}}, "prompt_lookup_min"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "foo": 1}}, "unknown field `foo`"),
    ({"speculative_config": {"method": "medusa", "num_speculative_tokens": 2}}, "method"),
    ({"speculative_algorithm": "NGRAM", "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "two spellings"),
    ({"speculative_num_draft_tokens": 3}, "need --speculative-algorithm"),
    ({"speculative_algorithm": "MEDUSA"}, "expected one of"),
    ({"speculative_lora_modules": ["x=/y"], "speculative_algorithm": "NGRAM"}, "need method draft_model or eagle3"),
])  # fmt: skip
def test_bad_settings_are_refused_with_their_cause(settings, cause):
    with pytest.raises(ConfigError, match=cause):
        ServerConfig(**settings)

