"""Model config parsing, checkpoint loading, layer sharding and KV cache sizing of the worker."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from loraplex.protocol.config import ServerConfig
from loraplex.worker.kv_cache import MAX_DEFAULT_TOKENS, default_kv_tokens, kv_bytes_per_token
from loraplex.worker.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from loraplex.worker.loader import CheckpointError, map_hf_name
from loraplex.worker.model.config import ModelConfig, ModelConfigError, merge_overrides
from loraplex.worker.model_runner import ModelRunner
from loraplex.worker.parallel import tensor_parallel
from safetensors.torch import load_file, save_file

BASE = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}


def test_reads_transformers_5_and_4_forms() -> None:
    v5 = ModelConfig.from_dict(
        {**BASE, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}, "dtype": "bfloat16"}
    )
    v4 = ModelConfig.from_dict({**BASE, "rope_theta": 5e5, "torch_dtype": "bfloat16"})
    assert v5 == v4
    assert v5.rope.theta == 5e5 and v5.rope.rope_type == "default" and v5.checkpoint_dtype == "bfloat16"
    assert v5.head_dim == 16 and not v5.qkv_bias and not v5.tie_word_embeddings
    legacy = ModelConfig.from_dict({**BASE, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy.rope.rope_type == "linear" and legacy.rope.params == {"factor": 2.0}


def test_model_specific_fields() -> None:
    assert ModelConfig.from_dict({**BASE, "head_dim": 32}).head_dim == 32
    qwen2 = ModelConfig.from_dict({**BASE, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False})
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.max_context_length == 2048
    assert qwen2.layer_windows == ()
    mistral = ModelConfig.from_dict({**BASE, "model_type": "mistral", "sliding_window": 1024})
    assert mistral.max_context_length == 2048 and mistral.layer_windows == (1024, 1024)  # every layer windowed
    qwen2_windowed = {**BASE, "model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True}
    assert ModelConfig.from_dict({**qwen2_windowed, "max_window_layers": 1}).layer_windows == (None, 64)
    biased = ModelConfig.from_dict({**BASE, "attention_bias": True, "mlp_bias": True})
    assert biased.qkv_bias and biased.o_bias and biased.mlp_bias
    qwen3 = ModelConfig.from_dict({**BASE, "model_type": "qwen3", "head_dim": 32, "sliding_window": 4096,
                                   "use_sliding_window": False})  # fmt: skip
    assert qwen3.head_dim == 32 and not qwen3.qkv_bias and qwen3.sliding_window is None


def test_hf_overrides_merge_before_the_config_is_read(tmp_path: Path) -> None:
    hf = {**BASE, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    overrides = {"num_hidden_layers": 1, "rope_scaling": {"factor": 4.0}, "model_type": "qwen3"}
    config = ModelConfig.from_dir(str(tmp_path), overrides)
    assert (config.num_layers, config.model_type, config.rope.rope_type, config.rope.params) == (
        1, "qwen3", "linear", {"factor": 4.0})  # nested objects merge key by key
    assert ModelConfig.from_dir(str(tmp_path)).num_layers == 2  # the file is left as it was
    assert merge_overrides({"a": {"b": 1}}, {"a": 3}) == {"a": 3}
    # a multimodal config: what its top level lacks goes to the language model's text_config
    assert merge_overrides({"model_type": "m", "text_config": {"num_hidden_layers": 34}},
                           {"num_hidden_layers": 2, "model_type": "n"}) == {
        "model_type": "n", "text_config": {"num_hidden_layers": 2}}  # fmt: skip
    with pytest.raises(ModelConfigError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_dir(str(tmp_path), {"model_type": "gpt2"})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gpt2"}, "unsupported model_type"),
        (
            {"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4, "factor": 4.0}},
            "unsupported rope scaling type 'mrope'",
        ),
        ({"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}, "rope scaling type 'proportional'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "missing low_freq_factor"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act"),
    ],
)
def test_unsupported_configs_fail_clearly(change: dict, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict({**BASE, **change})


def test_hf_names_map_to_fused_slices() -> None:
    assert map_hf_name("model.layers.3.self_attn.k_proj.weight") == ("model.layers.3.self_attn.qkv_proj.weight", 1)
    assert map_hf_name("model.layers.0.self_attn.v_proj.bias") == ("model.layers.0.self_attn.qkv_proj.bias", 2)
    assert map_hf_name("model.layers.0.mlp.up_proj.weight") == ("model.layers.0.mlp.gate_up_proj.weight", 1)
    assert map_hf_name("model.layers.0.mlp.down_proj.weight") == ("model.layers.0.mlp.down_proj.weight", None)
    assert map_hf_name("lm_head.weight") == ("lm_head.weight", None)


def test_linear_weight_loaders_keep_this_ranks_shard() -> None:
    q, kv, hidden = torch.randn(8, 6), torch.randn(4, 6), 6
    k, v = kv, kv + 1
    with tensor_parallel(rank=1, world_size=2):
        qkv = MergedColumnParallelLinear(hidden, [8, 4, 4], bias=True)
        col = ColumnParallelLinear(hidden, 8)
        row = RowParallelLinear(8, hidden, bias=True)
    for slice_id, full in enumerate((q, k, v)):
        qkv.weight_loader(qkv.weight, full, slice_id)
        qkv.weight_loader(qkv.bias, full[:, 0], slice_id)
    assert torch.equal(qkv.weight, torch.cat([q[4:], k[2:], v[2:]]))
    assert torch.equal(qkv.bias, torch.cat([q[4:, 0], k[2:, 0], v[2:, 0]]))
    assert (qkv.tp_mode, qkv.tp_rank, qkv.tp_size) == ("column", 1, 2)
    assert qkv.input_size == qkv.input_size_per_rank == hidden
    assert qkv.output_sizes == [8, 4, 4] and qkv.output_sizes_per_rank == [4, 2, 2]
    assert qkv.output_offsets_per_rank == [0, 4, 6]
    col.weight_loader(col.weight, q)
    assert torch.equal(col.weight, q[4:]) and col.output_sizes == [8]
    row_weight = torch.randn(hidden, 8)
    row.weight_loader(row.weight, row_weight)
    row.weight_loader(row.bias, row_weight[:, 0])
    assert torch.equal(row.weight, row_weight[:, 4:]) and torch.equal(row.bias, row_weight[:, 0])
    assert (row.tp_mode, row.input_size, row.input_size_per_rank, row.output_sizes) == ("row", 8, 4, [hidden])
    with pytest.raises(ValueError, match="shape"):
        qkv.weight_loader(qkv.weight, torch.randn(8, 7), 0)
    with pytest.raises(ValueError, match="not divisible"), tensor_parallel(rank=0, world_size=3):
        ColumnParallelLinear(hidden, 8)


def runner_config(**kwargs) -> ServerConfig:
    return ServerConfig(device="cpu", page_size=16, **kwargs)


def test_context_length_and_default_kv_size(llama_dir: Path) -> None:
    runner = ModelRunner(runner_config(max_running_requests=3, context_length=100), str(llama_dir), 0, 1, "cpu")
    assert runner.context_length == 100
    assert runner.max_total_tokens == 288  # 3 * 100 rounded down to whole pages of 16
    default = ModelRunner(runner_config(max_running_requests=1), str(llama_dir), 0, 1, "cpu")
    assert default.context_length == 2048  # the model's max_position_embeddings
    assert default.max_total_tokens == 2048
    with pytest.raises(ModelConfigError, match="exceeds the model's maximum of 2048"):
        ModelRunner(runner_config(context_length=4096), str(llama_dir), 0, 1, "cpu")


def test_a_checkpoint_tensor_no_parameter_reads_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")
    tensors = load_file(llama_dir / "model.safetensors")
    # carry nothing the forward pass reads: a rotary table, a layer the model is built without, a bias of zeros,
    # an FP8 KV cache's static scales (compressed-tensors' kv_cache_scheme; the cache here keeps the model dtype)
    harmless = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
                "model.layers.0.self_attn.k_scale": torch.tensor(0.02),
                "model.layers.1.self_attn.v_scale": torch.tensor(0.03),
                "model.layers.2.mlp.down_proj.weight": torch.ones(64, 128),
                "model.layers.1.mlp.up_proj.bias": torch.zeros(128)}
    save_file({**tensors, **harmless}, tmp_path / "model.safetensors")
    ModelRunner(runner_config(), str(tmp_path), 0, 1, "cpu")
    for stray in ("model.layers.1.mlp.down_proj.weight_scale", "model.layers.0.self_attn.o_proj.bias"):
        save_file({**tensors, **harmless, stray: torch.full((64,), 0.5)}, tmp_path / "model.safetensors")
        with pytest.raises(CheckpointError, match=f"1 tensors no parameter here reads.*{stray}$"):
            ModelRunner(runner_config(), str(tmp_path), 0, 1, "cpu")
    # quantized values without a quantization_config are not read as weights
    name = "model.layers.0.mlp.gate_proj.weight"
    save_file({**tensors, name: tensors[name].to(torch.float8_e4m3fn)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{name}: stored as float8_e4m3fn"):
        ModelRunner(runner_config(), str(tmp_path), 0, 1, "cpu")


def test_default_kv_tokens_caps() -> None:
    per_token = kv_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert per_token == 2 * 32 * 8 * 128 * 2
    cpu = torch.device("cpu")
    assert default_kv_tokens(max_running_requests=64, context_length=10**6, bytes_per_token=1, device=cpu) == (
        MAX_DEFAULT_TOKENS
    )
    # A token larger than the memory budget leaves no room at all.
    assert default_kv_tokens(max_running_requests=1, context_length=10, bytes_per_token=2**60, device=cpu) == 0


def test_checkpoint_errors(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="does not exist"):
        ModelRunner(runner_config(), str(tmp_path / "nope"), 0, 1, "cpu")
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(llama_dir / "config.json", broken / "config.json")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        ModelRunner(runner_config(), str(broken), 0, 1, "cpu")
    tensors = load_file(llama_dir / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "layers.1.self_attn.k_proj" not in k}, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"qkv_proj.weight\[1\]"):
        ModelRunner(runner_config(), str(broken), 0, 1, "cpu")
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.norm.weight.*shape"):
        ModelRunner(runner_config(), str(broken), 0, 1, "cpu")
    config = json.loads((llama_dir / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_attention_heads": 3}))
    with pytest.raises(ModelConfigError, match="tp 2 must divide"):
        ModelRunner(runner_config(tp=2), str(broken), 0, 2, "cpu")
