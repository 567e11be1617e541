from __future__ import annotations

import hashlib
import json
import os
import re
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loraplex.frontend.demo import DEMO_ADAPTERS, demo_adapter_paths
from loraplex.protocol.adapters.lora_targets import MLP_MODULES, TARGET_MODULES
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from tests import builders
from tests.builders import (
    build_lora_adapter,
    build_tiny_model,
    build_tokenizer,
)
from tests.demo_tasks import ADAPTER_TASKS, BASE_TASK, accuracy, greedy_answers, held_out_inputs

BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = 1, 2, 3, 4
VOCAB_SIZE = 1000

UNICODE_TEXTS = [
    "Hello, world!",
    "  leading spaces, double  spaces and a trailing one ",
    "tabs\tand\nnewlines\r\n",
    "café, naïve, Ångström, Łódź, São Paulo",
    "e\u0301 (combining accent) vs \u00e9",
    "日本語のテキストと中文文本",
    "한국어 텍스트",
    "emoji 😀🎉👍🏽 and a family 👨\u200d👩\u200d👧",
    "Ελληνικά, русский, עברית, العربية",
    "math ∑ ∫ √ ≤ ≥ ∞ and $12.50 at 14:30",
]


def _load(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def _random_prompts(num_prompts: int = 32, prompt_len: int = 16, seed: int = 123) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # Ids from 5 up: skip the special tokens.
    return torch.randint(5, VOCAB_SIZE, (num_prompts, prompt_len), generator=generator)


def _margins(logits: torch.Tensor) -> torch.Tensor:
    top2 = logits.float().topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]).flatten()


# --- tokenizer ---------------------------------------------------------------------------------


def _read_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_tokenizer_build_is_deterministic(tmp_path: Path) -> None:
    builds = []
    for name in ("first", "second"):
        builders._tokenizer_json.cache_clear()  # retrain, don't reuse the cached result
        build_tokenizer(tmp_path / name)
        builds.append(_read_files(tmp_path / name))
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= builds[0].keys()
    assert builds[0] == builds[1]


def test_tokenizer_build_is_deterministic_across_processes(tmp_path: Path) -> None:
    # Tokenizer training could depend on hash-map order, which differs per process.
    build_tokenizer(tmp_path / "here")
    code = "import sys; from tests.builders import build_tokenizer; build_tokenizer(sys.argv[1])"
    env = dict(os.environ, PYTHONHASHSEED="12345", RAYON_NUM_THREADS="1")
    repo_root = Path(builders.__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "there")], check=True, cwd=repo_root, env=env)
    assert _read_files(tmp_path / "here") == _read_files(tmp_path / "there")


def test_tokenizer_special_tokens(llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    assert len(tokenizer) == VOCAB_SIZE
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == ("<s>", "</s>", "<unk>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_ID, EOS_ID)
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [IM_START_ID, IM_END_ID]
    # Special tokens in text map to their single ids.
    assert tokenizer("<|im_start|>user<|im_end|>", add_special_tokens=False).input_ids[0] == IM_START_ID
    assert tokenizer("<|im_start|>user<|im_end|>", add_special_tokens=False).input_ids[-1] == IM_END_ID


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_tokenizer_round_trips_unicode(llama_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    with_bos = tokenizer(text).input_ids
    assert tokenizer.decode(with_bos, skip_special_tokens=True) == text


def test_tokenizer_adds_bos_by_default_only(llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    text = "The weather is cold today."
    plain = tokenizer(text, add_special_tokens=False).input_ids
    default = tokenizer(text).input_ids
    assert default == [BOS_ID, *plain]
    assert BOS_ID not in plain and EOS_ID not in default
    assert tokenizer.encode(text) == default


def test_tokenizer_compresses_english(llama_dir: Path) -> None:
    # A trained BPE, not a byte fallback: plain English takes far fewer tokens than bytes.
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    text = "The farmer walked down the lane to the market, where the baker sold warm bread."
    assert len(text) / len(tokenizer(text, add_special_tokens=False).input_ids) > 2.5


def test_chat_template(llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there!"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n"
    )
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without_prompt.endswith("Hi there!<|im_end|>\n")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    # Exactly one BOS: the template's own, none added on top.
    assert ids[:2] == [BOS_ID, IM_START_ID] and ids.count(BOS_ID) == 1
    assert ids.count(IM_END_ID) == 2
    assert ids == tokenizer(rendered, add_special_tokens=False).input_ids


# --- base models -------------------------------------------------------------------------------


def test_llama_config_and_generation_config(llama_dir: Path) -> None:
    config = AutoConfig.from_pretrained(llama_dir)
    assert config.model_type == "llama"
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (VOCAB_SIZE, 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 128)
    assert (config.bos_token_id, config.eos_token_id, config.tie_word_embeddings) == (BOS_ID, EOS_ID, False)
    generation_config = GenerationConfig.from_pretrained(llama_dir)
    assert generation_config.eos_token_id == [EOS_ID, IM_END_ID]


@pytest.mark.parametrize("arch_dir", ["llama_dir", "qwen2_dir"])
def test_model_loads_offline_and_is_decisive(arch_dir: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(arch_dir)
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        logits = model.eval()(_random_prompts()).logits  # (prompts, len, vocab)
    margins = _margins(logits)
    assert margins.median() > 0.5, f"median top-1/top-2 margin {margins.median():.3f}"
    assert (margins < 1e-3).float().mean() < 0.01


@pytest.mark.parametrize(("arch", "tie_word_embeddings"), [("mistral", False), ("llama", True), ("qwen2", True)])
def test_other_archs_build_and_load(tmp_path: Path, arch: str, tie_word_embeddings: bool) -> None:
    build_tiny_model(tmp_path, arch=arch, tie_word_embeddings=tie_word_embeddings, with_tokenizer=False)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.model_type == arch
    assert model.config.tie_word_embeddings == tie_word_embeddings
    is_tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert is_tied == tie_word_embeddings


def test_greedy_generation_does_not_collapse(llama_dir: Path) -> None:
    model = _load(llama_dir)
    prompts = _random_prompts(num_prompts=8, prompt_len=8)
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    for row in out[:, 8:].tolist():
        assert len(set(row)) >= 12, row
        assert row[0] != row[1] or row[1] != row[2], row


def test_qwen2_has_nonzero_qkv_bias(qwen2_dir: Path) -> None:
    model = _load(qwen2_dir)
    assert model.config.model_type == "qwen2"
    for layer in model.model.layers:
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert proj.bias is not None and proj.bias.abs().mean() > 0.1
        assert attn.o_proj.bias is None


def test_model_build_is_deterministic_and_seeded(tmp_path: Path) -> None:
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        build_tiny_model(tmp_path / name, seed=seed, with_tokenizer=False)
    weights = {name: (tmp_path / name / "model.safetensors").read_bytes() for name in "abc"}
    assert weights["a"] == weights["b"]
    assert weights["a"] != weights["c"]
    assert not (tmp_path / "a" / "tokenizer.json").exists()


def test_bf16_build_matches_fp32_rounded(tmp_path: Path, llama_dir: Path) -> None:
    build_tiny_model(tmp_path, dtype=torch.bfloat16, with_tokenizer=False)
    fp32 = load_file(llama_dir / "model.safetensors")
    bf16 = load_file(tmp_path / "model.safetensors")
    assert fp32.keys() == bf16.keys()
    for key, value in bf16.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, fp32[key].to(torch.bfloat16)), key


# --- adapters ----------------------------------------------------------------------------------


def test_adapter_config_and_shapes(adapter_dirs: dict[str, Path], adapter_specs, llama_dir: Path) -> None:
    assert len(adapter_dirs) >= 5
    for name, path in adapter_dirs.items():
        r, alpha, targets, rslora = adapter_specs[name]
        config = json.loads((path / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
        assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (r, alpha, rslora)
        assert sorted(config["target_modules"]) == sorted(targets)
        assert config["base_model_name_or_path"] == str(llama_dir)
        assert (config["lora_dropout"], config["bias"], config["fan_in_fan_out"]) == (0.0, "none", False)
        tensors = load_file(path / "adapter_model.safetensors")
        assert len(tensors) == 2 * 2 * len(targets)  # 2 layers, A and B per target
        q_a = tensors.get("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight")
        down_b = tensors.get("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight")
        if "q_proj" in targets:
            assert q_a.shape == (r, 64)
        if "down_proj" in targets:
            assert down_b.shape == (64, r)
        # Both factors random: PEFT's own init has B == 0, which would make the adapter a no-op.
        assert all(t.abs().mean() > 1e-3 for t in tensors.values())


def test_adapter_build_does_not_need_peft(tmp_path: Path, llama_dir: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # any `import peft` now raises ImportError
    build_lora_adapter(llama_dir, tmp_path, r=2, lora_alpha=4, target_modules=["o_proj"])
    assert (tmp_path / "adapter_model.safetensors").exists()


def test_adapter_rejects_unknown_target(tmp_path: Path, llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="lm_head"):
        build_lora_adapter(llama_dir, tmp_path, r=2, lora_alpha=4, target_modules=["q_proj", "lm_head"])


@pytest.mark.parametrize("name", ["a4", "a8", "a16", "a32", "a64"])
def test_adapter_loads_in_peft_and_changes_logits(
    name: str, adapter_dirs: dict[str, Path], adapter_specs, llama_dir: Path
) -> None:
    from peft import PeftModel

    r, alpha, targets, rslora = adapter_specs[name]
    prompts = _random_prompts()
    base = _load(llama_dir)
    with torch.no_grad():
        base_logits = base(prompts).logits
    base_weights = {k: v.clone() for k, v in base.state_dict().items()}

    peft_model = PeftModel.from_pretrained(_load(llama_dir), adapter_dirs[name]).eval()
    # No missing or unexpected keys: the LoRA parameters PEFT created are exactly the file's.
    file_tensors = load_file(adapter_dirs[name] / "adapter_model.safetensors")
    lora_params = {k.replace(".default", ""): v for k, v in peft_model.named_parameters() if ".lora_" in k}
    assert lora_params.keys() == file_tensors.keys()
    for key, value in file_tensors.items():
        assert torch.equal(lora_params[key], value), key
    expected_scaling = alpha / (r**0.5 if rslora else r)
    block = "mlp" if targets[0] in MLP_MODULES else "self_attn"
    lora_layer = peft_model.get_submodule(f"base_model.model.model.layers.0.{block}.{targets[0]}")
    assert lora_layer.scaling["default"] == pytest.approx(expected_scaling)

    with torch.no_grad():
        lora_logits = peft_model(prompts).logits
    assert (lora_logits - base_logits).abs().max() > 1.0
    assert (lora_logits.argmax(-1) != base_logits.argmax(-1)).float().mean() > 0.3
    assert _margins(lora_logits).median() > 0.5

    # Reference: merge W + scaling * B @ A by hand, with our reading of the key layout.
    merged = dict(base_weights)
    for key, lora_a in file_tensors.items():
        if ".lora_A." not in key:
            continue
        lora_b = file_tensors[key.replace(".lora_A.", ".lora_B.")]
        weight_key = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        merged[weight_key] = merged[weight_key] + expected_scaling * lora_b @ lora_a  # (out, r) @ (r, in)
    reference = _load(llama_dir)
    reference.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(reference(prompts).logits, lora_logits, atol=1e-3, rtol=1e-4)


def test_adapters_differ_from_each_other(adapter_dirs: dict[str, Path], llama_dir: Path) -> None:
    from peft import PeftModel

    prompts = _random_prompts(num_prompts=8)
    next_ids = []
    for path in adapter_dirs.values():
        with torch.no_grad():
            logits = PeftModel.from_pretrained(_load(llama_dir), path).eval()(prompts).logits
        next_ids.append(logits.argmax(-1))
    for i in range(len(next_ids)):
        for j in range(i + 1, len(next_ids)):
            assert (next_ids[i] != next_ids[j]).float().mean() > 0.3


# --- the built-in demo -------------------------------------------------------------------------


def test_demo_assets_match_their_manifest(demo_dir: Path) -> None:
    # Every shipped file is listed with its SHA-256, and nothing unlisted ships.
    manifest = (demo_dir / "SHA256SUMS").read_text().splitlines()
    listed = dict(reversed(line.split("  ", 1)) for line in manifest)
    shipped = {
        str(p.relative_to(demo_dir))
        for p in demo_dir.rglob("*")
        if p.is_file() and p.name != "SHA256SUMS" and "__pycache__" not in p.parts
    }
    assert set(listed) == shipped
    for name, digest in listed.items():
        assert hashlib.sha256((demo_dir / name).read_bytes()).hexdigest() == digest, name
    total_bytes = sum((demo_dir / name).stat().st_size for name in listed)
    assert total_bytes < 32 * 2**20  # a few MB of package data


def test_demo_model_and_adapters(demo_dir: Path) -> None:
    config = AutoConfig.from_pretrained(demo_dir)
    assert config.model_type == "llama" and 1e6 < _num_parameters(config) < 1e7
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    assert config.vocab_size == len(tokenizer)
    for letter in string.ascii_letters:  # every letter in both cases is one token of its own
        [token_id] = tokenizer(letter, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode([token_id]) == letter
    assert tokenizer("hello world =")["input_ids"][0] == tokenizer.bos_token_id
    paths = demo_adapter_paths(demo_dir)
    assert list(paths) == list(DEMO_ADAPTERS) == list(ADAPTER_TASKS)  # the server's names are the trained tasks
    for name, path in paths.items():
        assert re.fullmatch(r"[a-z0-9-]+", name) and path == demo_dir / "adapters" / name
        adapter_config = json.loads((path / "adapter_config.json").read_text())
        assert sorted(adapter_config["target_modules"]) == sorted(TARGET_MODULES)
        assert adapter_config["base_model_name_or_path"] == "demo"
        assert (path / "adapter_model.safetensors").is_file()


def _num_parameters(config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def test_demo_tasks_in_transformers_and_peft(demo_dir: Path) -> None:
    # The same files through HF and peft: base and adapters do their tasks (the server test covers 200 inputs).
    from peft import PeftModel

    inputs = held_out_inputs()[:40]
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    assert accuracy(BASE_TASK, inputs, greedy_answers(_load(demo_dir), tokenizer, inputs)) >= 0.95
    for name, path in demo_adapter_paths(demo_dir).items():
        model = PeftModel.from_pretrained(_load(demo_dir), path).eval()
        assert accuracy(name, inputs, greedy_answers(model, tokenizer, inputs)) >= 0.95, name
