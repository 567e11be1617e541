"""Every shipped real quantized config.json (tests/data/model_configs/, those with a quantization_config) starts a
server with `--load-format dummy` and two layers at the model's real widths and vocabulary: /server_info names the
method, the base and a LoRA adapter built for those shapes answer (differently), and the linear weights held are
the format's size (INT4 about a quarter of bfloat16, FP8 half), as the start-up log reports them."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from loraplex.worker.model.config import ModelConfig
from safetensors.torch import save_file

from tests.builders import build_tokenizer
from tests.server_utils import ServerProcess

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "data" / "model_configs"
# shipped directory -> (its Hub id, the method served, linear weight bytes held / bfloat16's)
QUANTIZED = {
    "Qwen3-8B-FP8": ("Qwen/Qwen3-8B-FP8", "fp8", (0.45, 0.56)),
    "Meta-Llama-3.1-8B-Instruct-AWQ-INT4": ("hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4", "awq", (0.22, 0.32)),
    "Qwen2.5-7B-Instruct-GPTQ-Int4": ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "gptq", (0.22, 0.32)),
    "Meta-Llama-3.1-8B-Instruct-quantized.w4a16": ("RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16",
                                                   "compressed-tensors", (0.22, 0.32)),
    "Meta-Llama-3.1-8B-Instruct-FP8-dynamic": ("RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8-dynamic", "compressed-tensors",
                                               (0.45, 0.56)),
}
NUM_LAYERS = 2
MAX_TOKENS = 4
ADAPTER_TARGETS = ("q_proj", "v_proj", "down_proj")


def test_every_shipped_quantized_config_is_served_here() -> None:
    shipped = {path.parent.name for path in CONFIGS_DIR.glob("*/config.json")
               if "quantization_config" in json.loads(path.read_text())}
    assert shipped == set(QUANTIZED)


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each decoder linear's (out, in), by PEFT's module name."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def write_adapter(config: ModelConfig, base_model: str, out_dir: Path, r: int = 4, std: float = 0.1) -> None:
    """A PEFT LoRA adapter (rank r) at the model's shapes: A and B random, their product about twice the base
    weights' scale, so it shows in the tokens chosen."""
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(NUM_LAYERS):
        for module in ADAPTER_TARGETS:
            out_features, in_features = linear_shapes(config)[module]
            block = "mlp" if module == "down_proj" else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(r, in_features, generator=generator) * std).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out_features, r, generator=generator) * std).bfloat16()
    out_dir.mkdir()
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    adapter_config = {"base_model_name_or_path": base_model, "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r,
                      "lora_alpha": 2 * r, "lora_dropout": 0.0, "target_modules": list(ADAPTER_TARGETS),
                      "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False}
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))


@pytest.mark.parametrize("model", sorted(QUANTIZED))
def test_quantized_real_config_serves_a_base_and_an_adapter(model: str, tmp_path: Path) -> None:
    hub_id, method, (low, high) = QUANTIZED[model]
    model_dir = tmp_path / model  # config.json and the tests' tiny tokenizer (ids inside every real vocabulary)
    model_dir.mkdir()
    shutil.copy(CONFIGS_DIR / model / "config.json", model_dir / "config.json")
    build_tokenizer(model_dir)
    config = ModelConfig.from_dir(str(model_dir), {"num_hidden_layers": NUM_LAYERS})
    write_adapter(config, hub_id, tmp_path / "adapter")
    with ServerProcess("--model-path", str(model_dir), "--load-format", "dummy", "--hf-overrides",
                       json.dumps({"num_hidden_layers": NUM_LAYERS}), "--dtype", "bfloat16", "--context-length", "128",
                       "--max-total-tokens", "512", "--max-running-requests", "4", "--lora-backend", "torch",
                       "--attention-backend", "torch", "--lora-paths", f"tuned={tmp_path / 'adapter'}",
                       "--max-lora-rank", "8", start_timeout_s=600) as server:  # fmt: skip
        assert server.get("/health").status_code == 200
        info = server.get("/server_info").json()
        assert (info["quantization"], info["load_format"], info["num_hidden_layers"]) == (method, "dummy", NUM_LAYERS)
        outputs = {}
        for name in (info["served_model_name"], "tuned"):
            body = {"model": name, "prompt": [5, 17, 33, 2, 9], "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}
            answer = server.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            outputs[name] = answer.json()["choices"][0]["token_ids"]
            assert len(outputs[name]) == MAX_TOKENS and all(0 <= t < config.vocab_size for t in outputs[name])
        log = server.log()
    assert outputs[info["served_model_name"]] != outputs["tuned"], outputs  # the adapter's term is applied
    held = re.search(rf"quantization: {method} \(--quantization auto\); linear weights ([\d.]+) MiB", log)
    assert held is not None, log[-3000:]
    bf16_mib = NUM_LAYERS * 2 * sum(o * i for o, i in linear_shapes(config).values()) / 2**20
    assert low <= float(held[1]) / bf16_mib <= high, (held[1], bf16_mib)
