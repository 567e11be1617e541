"""The command line: `loraplex [flags]` and `loraplex serve MODEL [flags]` (vLLM's form), generated in one place
(`build_arg_parser`) from ServerConfig's fields and their help (protocol/config.py), grouped by topic for `--help`, with
vLLM's and SGLang's spellings (ALIASES) and their flags that have no setting here (foreign_flags.py). Only the launcher
imports it: the processes it starts are handed the ServerConfig itself."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn

import msgspec
from loraplex.frontend.entrypoints.foreign_flags import FOREIGN_BY_DEST, FOREIGN_FLAGS
from loraplex.protocol.config import ALIASES, VALUE_ALIASES, ConfigError, ServerConfig, flag_name

# `loraplex --help` shows the flags in these groups, in this order; every field belongs to exactly one.
_TOPICS: dict[str, str] = {
    "model and devices": "model_path served_model_name revision tokenizer tokenizer_revision download_dir hf_token "
    "load_format hf_overrides device dtype quantization tp enable_expert_parallel dp_size "
    "context_length seed runner convert task is_embedding",
    "HTTP server and access": "host port api_key admin_api_key rpc_addr shutdown_timeout log_level "
    "max_requests_per_minute_per_key max_tokens_per_minute_per_key",
    "LoRA adapters": "enable_lora lora_paths lora_modules max_loras_per_batch max_loaded_loras max_lora_rank "
    "max_full_module_copies lora_target_modules lora_backend lora_path_root lora_resolver_dir lora_cache_dir "
    "lora_cache_max_gb lora_state_file disable_lora_updates lora_drain_timeout lora_load_timeout "
    "enable_tower_connector_lora",
    "scheduling and KV cache": "max_running_requests max_total_tokens max_prefill_tokens chunked_prefill_size "
    "page_size disable_radix_cache no_enable_prefix_caching gpu_memory_utilization max_running_per_adapter "
    "disable_adapter_fairness scheduling_policy max_mamba_cache_size max_state_snapshots mamba_ssm_cache_dtype "
    "kv_cache_dtype calculate_kv_scales",
    "attention and CUDA graphs": "attention_backend enable_cuda_graph disable_cuda_graph cuda_graph_max_bs",
    "multi-node": "nnodes node_rank dist_init_addr dist_interface dist_timeout",
    "images": "allowed_local_media_path limit_mm_per_prompt",
    "chat and tools": "chat_template enable_auto_tool_choice tool_call_parser reasoning_parser",
    "speculative decoding": "speculative_config speculative_algorithm speculative_draft_model_path "
    "speculative_num_draft_tokens speculative_lora_modules",
    "security and audit": "allow_unauthenticated_lora_updates cluster_key_file audit_log lora_allow_base_mismatch "
    "lora_strict_base_match lora_require_manifest",
}
# A field missing from _TOPICS lands here (tests/process/test_help_and_progress.py catches it).
OTHER_TOPIC = "other options"


def field_topic(name: str) -> str:
    return next((topic for topic, names in _TOPICS.items() if name in names.split()), OTHER_TOPIC)


# vLLM's short forms
_SHORT: dict[str, str] = {"tensor_parallel_size": "-tp", "data_parallel_size": "-dp", "quantization": "-q"}


def _field_type(field: msgspec.structs.FieldInfo) -> tuple[str, Any, str]:
    """Classify a field for argparse: (kind, element type, help)."""
    info = msgspec.inspect.type_info(field.type)
    help_text = ""
    if isinstance(info, msgspec.inspect.Metadata):  # Annotated[..., Meta(description=help)]
        help_text = (info.extra_json_schema or {}).get("description", "")
        info = info.type
    if isinstance(info, msgspec.inspect.UnionType):
        info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
    if isinstance(info, msgspec.inspect.BoolType):
        return "bool", None, help_text
    if isinstance(info, msgspec.inspect.ListType):
        return "list", str, help_text
    if isinstance(info, msgspec.inspect.DictType):
        return "scalar", json_object, help_text
    if isinstance(info, msgspec.inspect.LiteralType):
        return "choice", list(info.values), help_text
    return "scalar", {msgspec.inspect.IntType: int, msgspec.inspect.FloatType: float}.get(type(info), str), help_text


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object value; argparse names the flag when this raises."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {text}")
    return value


FOREIGN_TOPIC = "vLLM and SGLang flags with no setting here, accepted with a log line or refused"


class _OneLineParser(argparse.ArgumentParser):
    """A usage error is one line naming the flag (the full usage is a screen long: --help shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_arg_parser(prog: str = "loraplex", *, model_positional: bool = False) -> argparse.ArgumentParser:
    """One flag per field, plus vLLM's and SGLang's spellings of some (ALIASES) and their flags we have no setting for
    (foreign_flags.py). A flag not given is absent from the parsed namespace (SUPPRESS), so the struct's
    defaults apply and a setting given in both spellings can be told apart. No abbreviations: `--model` is a flag of
    its own, and a prefix of a flag is an error, as in vLLM. With model_positional (`loraplex serve MODEL`), MODEL
    is the first positional argument."""
    parser = _OneLineParser(
        prog=prog,
        description="loraplex: many LoRA adapters on one base model",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    if model_positional:
        parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="the same as --model-path MODEL")
    groups = {topic: parser.add_argument_group(topic) for topic in (*_TOPICS, OTHER_TOPIC)}
    fields = {field.name: field for field in msgspec.structs.fields(ServerConfig)}
    # Topic by topic, in the order _TOPICS lists them, each other spelling right after ours.
    ordered = [name for names in _TOPICS.values() for name in names.split() if name in fields]
    ordered += [name for name in fields if name not in ordered]
    entries = [(dest, name) for name in ordered for dest in (name, *sorted(a for a, n in ALIASES.items() if n == name))]
    for dest, name in entries:
        field = fields[name]
        group = groups[field_topic(name)]
        kind, elem, field_help = _field_type(field)
        help_text = field_help if dest == name else f"the same as --{flag_name(name)} (vLLM's or SGLang's name)"
        option_strings = ["--" + flag_name(dest), *([_SHORT[dest]] if dest in _SHORT else [])]
        default = field.default
        if kind == "bool":
            group.add_argument(*option_strings, dest=dest, action="store_true", help=help_text)
        elif kind == "list":
            group.add_argument(*option_strings, dest=dest, nargs="+", help=help_text)
        elif kind == "choice":
            choices = [*elem, *VALUE_ALIASES.get(name, {})]
            group.add_argument(*option_strings, dest=dest, choices=choices, help=f"{help_text} (default: {default})")
        else:
            group.add_argument(*option_strings, dest=dest, type=elem, help=f"{help_text} (default: {default})")
    foreign = parser.add_argument_group(FOREIGN_TOPIC)
    for flag in FOREIGN_FLAGS:
        help_text = f"({flag.family}) {flag.summary}"
        if flag.takes_value:
            foreign.add_argument(*flag.names, dest=flag.dest, metavar="VALUE", help=help_text)
        else:
            foreign.add_argument(*flag.names, dest=flag.dest, action="store_true", help=help_text)
    return parser


def parse_command_line(argv: list[str] | None = None) -> tuple[ServerConfig, list[str]]:
    """`loraplex [flags]` or `loraplex serve MODEL [flags]` (vLLM's form) -> the config, and one note per accepted
    flag of vLLM's or SGLang's that changes nothing here (for the start-up log). A refused flag is a ConfigError
    naming it and why."""
    argv = sys.argv[1:] if argv is None else list(argv)
    is_serve = bool(argv) and argv[0] == "serve"
    parser = build_arg_parser("loraplex serve" if is_serve else "loraplex", model_positional=is_serve)
    kwargs = vars(parser.parse_args(argv[1:] if is_serve else argv))
    if "model_tag" in kwargs:
        model = kwargs.pop("model_tag")
        given = [f"--{flag_name(k)}" for k in ("model_path", "model") if k in kwargs]
        if given:
            raise ConfigError(f"the model is given twice: as MODEL ({model}) and as {given[0]}; give it once")
        kwargs["model_path"] = model
    notes = []
    for dest in [k for k in kwargs if k in FOREIGN_BY_DEST]:
        flag, value = FOREIGN_BY_DEST[dest], kwargs.pop(dest)
        try:
            notes.append(flag.check(value if flag.takes_value else None))
        except ValueError as e:
            raise ConfigError(str(e)) from e
        for name, setting in (flag.sets or {}).items():
            if name in kwargs:
                raise ConfigError(f"{flag.names[0]} and --{flag_name(name)} are the same setting: give only one")
            kwargs[name] = setting
    return ServerConfig.from_kwargs(**kwargs), notes


def config_from_args(argv: list[str] | None = None) -> ServerConfig:
    return parse_command_line(argv)[0]
