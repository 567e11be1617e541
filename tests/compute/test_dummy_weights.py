"""--load-format dummy and --hf-overrides in the worker: random weights on a config.json alone, the same model at every
TP degree, and overrides that change what is built (checked against HF built with the same overrides)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from loraplex.worker.dummy_weights import init_dummy_weights
from loraplex.worker.model.config import ModelConfig
from loraplex.worker.model.registry import build_model
from loraplex.worker.parallel import tensor_parallel
from transformers import AutoModelForCausalLM

from tests.worker_helpers import make_runner, prefill_logits, random_prompts

STD = 0.02


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory: pytest.TempPathFactory, qwen2_dir: Path) -> Path:
    """Qwen2's config.json (qkv biases, untied head) and no weight files."""
    path = tmp_path_factory.mktemp("config_only")
    shutil.copy(qwen2_dir / "config.json", path / "config.json")
    return path


def dummy_model(model_dir: Path, rank: int, world_size: int, seed: int = 0) -> torch.nn.Module:
    with tensor_parallel(rank, world_size):
        model = build_model(ModelConfig.from_dir(str(model_dir)), max_positions=64)
    init_dummy_weights(model, STD, seed)
    return model


def test_dummy_weights_are_hf_like_and_the_same_at_every_tp_degree(config_only_dir: Path) -> None:
    full = dummy_model(config_only_dir, 0, 1)
    params = dict(full.named_parameters())
    assert all(torch.all(p == 1) for n, p in params.items() if n.endswith("norm.weight"))
    assert all(torch.all(p == 0) for n, p in params.items() if n.endswith(".bias"))
    embed = params["model.embed_tokens.weight"]
    assert abs(embed.std().item() - STD) < 0.1 * STD and not torch.equal(embed, params["lm_head.weight"])
    attn = full.model.layers[0].self_attn
    q_size, kv_size, _ = attn.qkv_proj.output_sizes
    q, k, v = attn.qkv_proj.weight.split([q_size, kv_size, kv_size])
    assert not torch.equal(k, v)  # each slice has its own draw
    for rank in (0, 1):
        shard = dummy_model(config_only_dir, rank, 2)
        shard_attn = shard.model.layers[0].self_attn
        # column-parallel: this rank's rows of each of q, k, v; row-parallel: its columns of o
        expected = torch.cat([t.chunk(2, dim=0)[rank] for t in (q, k, v)])
        assert torch.equal(shard_attn.qkv_proj.weight, expected)
        assert torch.equal(shard_attn.o_proj.weight, attn.o_proj.weight.chunk(2, dim=1)[rank])
        assert torch.equal(shard.model.embed_tokens.weight, embed)  # replicated
    assert not torch.equal(dummy_model(config_only_dir, 0, 1, seed=1).model.embed_tokens.weight, embed)


def test_dummy_runner_needs_no_weight_files(config_only_dir: Path) -> None:
    prompt = random_prompts([9], 256, seed=3)[0]
    runners = [make_runner(config_only_dir, load_format="dummy", seed=seed) for seed in (0, 0, 1)]
    logits = [prefill_logits(runner, prompt) for runner in runners]
    assert torch.isfinite(logits[0]).all()
    assert torch.equal(logits[0], logits[1]) and not torch.equal(logits[0], logits[2])


def test_overrides_change_the_model_built(qwen3_dir: Path) -> None:
    # Real weights with one layer of two: the checkpoint's second layer is left unread, and the outputs are HF's
    # with the same override.
    runner = make_runner(qwen3_dir, hf_overrides={"num_hidden_layers": 1})
    assert runner.model_config.num_layers == 1 and len(runner.model.model.layers) == 1
    hf = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32, num_hidden_layers=1).eval()
    prompt = random_prompts([11], runner.vocab_size, seed=5)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (prefill_logits(runner, prompt) - ref).abs().max().item() <= 1e-4
    dummy = make_runner(qwen3_dir, load_format="dummy", hf_overrides={"num_hidden_layers": 3, "vocab_size": 512})
    assert len(dummy.model.model.layers) == 3 and dummy.vocab_size == 512
