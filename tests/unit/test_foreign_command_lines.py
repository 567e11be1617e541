"""Command lines from vLLM's and SGLang's LoRA serving docs, the program name replaced by `loraplex` (the model and
adapters by Hub id, as there): each parses into the settings it asks for, or is refused with one line naming the flag
and why. tests/process/test_their_command_lines_start.py starts servers from them against a local Hub stand-in."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from loraplex.frontend.entrypoints.cli import build_arg_parser, parse_command_line
from loraplex.frontend.entrypoints.foreign_flags import FOREIGN_FLAGS
from loraplex.protocol.config import ALIASES, ConfigError, ServerConfig

MODEL, A, B = "meta-llama/Llama-2-7b-hf", "yard1/llama-2-7b-sql-lora-test", "algoprog/fact-generation-llama-3.1-8b-lora"
DOCS_API = Path(__file__).resolve().parents[2] / "docs" / "API.md"

# vLLM: docs/features/lora.md and its serving examples; SGLang: docs/advanced_features/lora.ipynb. `vllm serve` and
# `python3 -m sglang.launch_server` became `loraplex serve` and `loraplex`.
ACCEPTED = [
    (  # vLLM: a LoRA module by NAME=PATH
        f"vllm serve {MODEL} --enable-lora --lora-modules sql-lora={A}",
        {"model_path": MODEL, "enable_lora": True, "lora_modules": [f"sql-lora={A}"]},
    ),
    (  # vLLM: a LoRA module as JSON with its base model's name
        f"""vllm serve {MODEL} --enable-lora --lora-modules '{{"name": "sql-lora", "path": "{A}", """
        '"base_model_name": "meta-llama/Llama-2-7b"}\'',
        {"model_path": MODEL, "enable_lora": True},
    ),
    (  # vLLM: dynamic adapters, pool shape given
        f"vllm serve {MODEL} --enable-lora --max-lora-rank 64 --max-loras 4 --max-cpu-loras 8",
        {"max_lora_rank": 64, "max_loras_per_batch": 4, "max_loaded_loras": 8},
    ),
    (  # vLLM: a production-looking line
        f"vllm serve {MODEL} --enable-lora --lora-modules sql-lora={A} --max-lora-rank 64 --tensor-parallel-size 2 "
        "--max-model-len 4096 --max-num-seqs 32 --gpu-memory-utilization 0.9 --enforce-eager --trust-remote-code "
        "--disable-log-requests --dtype half --seed 1 --port 8000 --host 0.0.0.0",
        {"tp": 2, "context_length": 4096, "max_running_requests": 32, "gpu_memory_utilization": 0.9,
         "disable_cuda_graph": True, "dtype": "float16", "seed": 1, "port": 8000, "host": "0.0.0.0"},
    ),
    (  # vLLM: the --model spelling, batching flags and the defaults said out loud
        f"vllm serve --model {MODEL} --enable-lora --max-lora-rank 32 --lora-dtype auto --max-num-batched-tokens 2048 "
        "--enable-prefix-caching --served-model-name base --api-key k -tp 1",
        {"model_path": MODEL, "chunked_prefill_size": 2048, "served_model_name": "base", "api_key": "k", "tp": 1},
    ),
    (  # SGLang: the LoRA docs' first server
        f"python3 -m sglang.launch_server --model-path {MODEL} --enable-lora --lora-paths lora0={A} "
        "--max-loras-per-batch 1 --lora-backend triton --log-level warning",
        {"model_path": MODEL, "lora_paths": [f"lora0={A}"], "max_loras_per_batch": 1, "lora_backend": "triton",
         "log_level": "warning"},
    ),
    (  # SGLang: two adapters, the chunked-SGMV backend (ours: the Triton kernels), every target module
        f"python3 -m sglang.launch_server --model-path {MODEL} --enable-lora --lora-paths lora0={A} lora1={B} "
        "--max-loras-per-batch 2 --lora-backend csgmv --max-lora-rank 256 --lora-target-modules all "
        "--cuda-graph-max-bs 2",
        {"lora_backend": "triton", "max_lora_rank": 256, "lora_target_modules": ["all"], "cuda_graph_max_bs": 2},
    ),
    (  # SGLang: dynamic loading, pool shape and memory given
        f"python3 -m sglang.launch_server --model-path {MODEL} --enable-lora --max-lora-rank 64 --lora-target-modules "
        "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj --max-loras-per-batch 2 --max-loaded-loras 4 "
        "--lora-eviction-policy lru --disable-radix-cache --mem-fraction-static 0.8 --tp-size 1 --random-seed 42",
        {"max_loaded_loras": 4, "disable_radix_cache": True, "gpu_memory_utilization": 0.8, "tp": 1, "seed": 42},
    ),
    (  # vLLM: an AWQ base under adapters (checked against the checkpoint's config.json at launch)
        f"vllm serve {MODEL} --enable-lora --lora-modules sql-lora={A} -q awq",
        {"quantization": "awq"},
    ),
    (  # SGLang: a pinned adapter as JSON
        f"""python3 -m sglang.launch_server --model-path {MODEL} --lora-paths """
        f"""'{{"lora_name": "lora0", "lora_path": "{A}", "pinned": true}}' lora1={B} --max-loras-per-batch 2 """
        "--trust-remote-code --attention-backend torch_native --dtype bfloat16",
        {"attention_backend": "torch", "dtype": "bfloat16"},
    ),
    (  # vLLM: a chat template file, tool calls read by a parser
        f"vllm serve {MODEL} --enable-lora --lora-modules sql-lora={A} --chat-template ./template_chatml.jinja "
        "--enable-auto-tool-choice --tool-call-parser hermes",
        {"chat_template": "./template_chatml.jinja", "enable_auto_tool_choice": True, "tool_call_parser": "hermes"},
    ),
    (  # SGLang: its name of the Llama 3 JSON parser
        f"python3 -m sglang.launch_server --model-path {MODEL} --lora-paths lora0={A} --tool-call-parser llama3",
        {"tool_call_parser": "llama3_json"},
    ),
]

REFUSED = [  # (command line, the flag its one line names)
    (f"vllm serve {MODEL} --enable-lora --lora-modules sql-lora={A} --cpu-offload-gb 4", "--cpu-offload-gb 4"),
    (f"python3 -m sglang.launch_server --model-path {MODEL} --enable-lora --lora-paths lora0={A} "
     "--lora-eviction-policy fifo", "--lora-eviction-policy fifo"),
]


def ours(command: str) -> list[str]:
    """The command line's arguments after its program: `vllm serve` -> `serve`, `python3 -m ...` -> nothing."""
    argv = shlex.split(command)
    return argv[1:] if argv[0] == "vllm" else argv[3:]


@pytest.mark.parametrize("command, expected", ACCEPTED, ids=[c[:40] for c, _ in ACCEPTED])
def test_their_command_line_parses_into_our_config(command: str, expected: dict[str, object]) -> None:
    config, notes = parse_command_line(ours(command))
    assert {name: getattr(config, name) for name in expected} == expected
    assert config.lora_enabled
    for flag in ("--trust-remote-code", "--disable-log-requests", "--enable-prefix-caching", "--lora-dtype",
                 "--lora-eviction-policy"):
        assert (flag in command) == any(note.startswith(flag) for note in notes), flag  # said once in the log


def test_json_lora_module_keeps_its_base_model() -> None:
    config = parse_command_line(ours(ACCEPTED[1][0]))[0]
    assert [(s.lora_name, s.lora_path, s.base_model_name) for s in config.lora_sources] == [
        ("sql-lora", A, "meta-llama/Llama-2-7b")]


@pytest.mark.parametrize("command, flag", REFUSED, ids=[f for _, f in REFUSED])
def test_their_command_line_for_a_missing_feature_is_refused_naming_it(command: str, flag: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_command_line(ours(command))
    message = str(info.value)
    assert message.startswith(flag + ":") and "\n" not in message and len(message) > len(flag) + 10


def test_serve_form_equals_model_path_form() -> None:
    tail = ["--enable-lora", "--max-lora-rank", "8"]
    assert parse_command_line(["serve", MODEL, *tail]) == parse_command_line(["--model-path", MODEL, *tail])
    assert parse_command_line(["--model", MODEL, *tail]) == parse_command_line(["--model-path", MODEL, *tail])
    assert parse_command_line(["serve", *tail, MODEL])[0].model_path == MODEL
    assert parse_command_line(["serve"])[0] == ServerConfig()  # the demo, as with no flags
    for argv in (["serve", MODEL, "--model-path", "/x"], ["serve", MODEL, "--model", "/x"],
                 ["--model", MODEL, "--model-path", "/x"]):
        with pytest.raises(ConfigError, match="give"):
            parse_command_line(argv)


@pytest.mark.parametrize("argv", [["--model-pa", "/m"], ["--max-lora", "8"], ["--tensor-parallel", "2"],
                                  ["serve", MODEL, "--enable-lo"]])
def test_no_abbreviations(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse_command_line(argv)


@pytest.mark.parametrize("flag", FOREIGN_FLAGS, ids=lambda f: f.names[0])
def test_each_foreign_flag_is_accepted_with_a_note_or_refused_with_a_reason(flag) -> None:
    value = "1" if flag.takes_value else None
    values = [*flag.ok_values, "something-else"] if flag.ok_values else [value]
    for value in values:
        argv = [flag.names[0], *([value] if value is not None else [])]
        accepted = bool(flag.note) and (not flag.refusal or value in flag.ok_values)
        if accepted:
            config, notes = parse_command_line(argv)
            assert notes == [f"{' '.join(argv)}: {flag.note}"]
            assert config == ServerConfig.from_kwargs(**(flag.sets or {}))  # changes nothing it does not name
        else:
            with pytest.raises(ConfigError, match=re.escape(f"{' '.join(argv)}: {flag.refusal}")):
                parse_command_line(argv)


def test_their_names_for_our_values() -> None:
    assert parse_command_line(["--dtype", "float"])[0].dtype == "float32"
    assert parse_command_line(["--lora-backend", "torch_native"])[0].lora_backend == "torch"
    assert ServerConfig.from_kwargs(dtype="half", enforce_eager=True, model="/m").dtype == "float16"
    assert parse_command_line(["--block-size", "32"])[0].page_size == 32
    with pytest.raises(ConfigError, match="give only one"):
        parse_command_line(["--no-enable-chunked-prefill", "--chunked-prefill-size", "256"])


def test_docs_table_lists_every_flag_of_theirs() -> None:
    text = DOCS_API.read_text()
    section = text[text.index("### vLLM and SGLang flags"):]
    section = section[:section.index("\n## ")]
    listed = set(re.findall(r"(?<![\w`])`(--?[a-z][a-z0-9-]*)", section))
    theirs = {f"--{alias.replace('_', '-')}" for alias in ALIASES} | {n for flag in FOREIGN_FLAGS for n in flag.names}
    assert sorted(theirs - listed) == []
    ours = {s for action in build_arg_parser()._actions for s in action.option_strings}
    assert sorted(listed - ours) == []  # every name there is a real flag: no stale rows
    # the table of their flags with no setting here names only such flags (a flag that became ours leaves it)
    table_rows = re.findall(r"^\| `(--[a-z0-9-]+)[^|]*\| (?:vLLM|SGLang)[^|]*\| (?:accepted|refused)", section, re.M)
    foreign = {name for flag in FOREIGN_FLAGS for name in flag.names}
    assert sorted(set(table_rows) - foreign) == []


def test_reasoning_parser_is_a_setting_of_ours() -> None:
    # vLLM's docs/features/reasoning_outputs.md and SGLang's separate_reasoning docs, program name changed
    config = parse_command_line(["serve", MODEL, "--reasoning-parser", "deepseek_r1"])[0]
    assert config.reasoning_parser == "deepseek_r1"
    assert parse_command_line(["--model-path", MODEL, "--reasoning-parser", "qwen3"])[0].reasoning_parser == "qwen3"
    assert parse_command_line(["--model-path", MODEL])[0].reasoning_parser is None
    for name, ours in [("deepseek-v3", "deepseek_v3"), ("gpt-oss", "openai_gptoss"), ("deepseek_v3", "deepseek_v3")]:
        assert parse_command_line(["--model-path", MODEL, "--reasoning-parser", name])[0].reasoning_parser == ours
    with pytest.raises(SystemExit):  # argparse names the valid choices
        parse_command_line(["--model-path", MODEL, "--reasoning-parser", "granite"])


def test_tool_flags() -> None:
    config = parse_command_line(["--enable-auto-tool-choice", "--tool-call-parser", "qwen25"])[0]
    assert (config.enable_auto_tool_choice, config.tool_call_parser) == (True, "hermes")
    for name, ours in [("deepseekv31", "deepseek_v3"), ("deepseek_v31", "deepseek_v3"), ("gpt-oss", "openai"),
                       ("kimi_k2", "kimi_k2"), ("llama4_pythonic", "llama4_pythonic")]:
        assert parse_command_line(["--tool-call-parser", name])[0].tool_call_parser == ours
    with pytest.raises(ConfigError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        parse_command_line(["--enable-auto-tool-choice"])
    with pytest.raises(SystemExit):
        parse_command_line(["--tool-call-parser", "nonesuch"])


def test_load_format_and_hf_overrides_are_settings_of_ours() -> None:
    # vLLM's docs: `vllm serve MODEL --load-format dummy --hf-overrides '{"num_hidden_layers": 2}'`
    config, notes = parse_command_line(ours(f"""vllm serve {MODEL} --load-format dummy --hf-overrides """
                                            """'{"num_hidden_layers": 2, "rope_scaling": {"factor": 4.0}}'"""))
    assert (config.load_format, config.hf_overrides, notes) == (
        "dummy", {"num_hidden_layers": 2, "rope_scaling": {"factor": 4.0}}, [])
    assert parse_command_line([])[0].load_format == "auto" and parse_command_line([])[0].hf_overrides == {}
    assert ServerConfig.from_kwargs(hf_overrides={"vocab_size": 512}).hf_overrides == {"vocab_size": 512}
    for argv in (["--load-format", "pt"], ["--hf-overrides", "{bad"], ["--hf-overrides", "[1, 2]"]):
        with pytest.raises(SystemExit):  # argparse: one line naming the flag
            parse_command_line(argv)
    with pytest.raises(ConfigError):
        ServerConfig.from_kwargs(hf_overrides=[1])
