"""MoE models under expert parallelism (--enable-expert-parallel): two gloo ranks, each holding half of the routed
experts whole (and their adapters' weights), attention and shared experts tensor-parallel, rows dispatched and
combined by all-to-all, serving the base model and two adapters in one batch, then a batch mixing decodes, a new
prompt and a prompt's second chunk, must reproduce tp=1. The families: Qwen3-MoE (per-expert and stacked expert
adapters), DeepSeek-V3 (grouped routing, shared experts, latent attention), gpt-oss with MXFP4 experts, Llama 4
(input-scaled experts, a shared expert), Gemma 4 (a dense MLP beside experts whose router reads its own input) and
GLM-4.5 (partial rotary, sigmoid routing with a correction bias, a shared expert); one launch of the two ranks serves
all six, one after another."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import msgspec
from loraplex.protocol.config import ServerConfig
from loraplex.worker.model_runner import ModelRunner

from tests.gemma4_models import build_gemma4_set
from tests.glm4_moe_models import build_glm4_moe_set
from tests.gpt_oss_models import build_gpt_oss_set
from tests.llama4_models import build_llama4_set
from tests.lora_helpers import mixed_prefill_decode_logits
from tests.mla_models import build_mla_set
from tests.moe_models import build_moe_set
from tests.mxfp4_checkpoint import write_mxfp4
from tests.process.test_moe_tp import LENGTHS, assert_ranks_match_tp1, run_moe, tp_config
from tests.worker_helpers import run_two_ranks, tp_group

LLAMA4_LENGTHS = [6, 9, 4, 13, 5]  # Llama 4's chunks of 6: one prompt crosses two


def ep_config(tp: int) -> ServerConfig:
    return msgspec.structs.replace(tp_config(tp), enable_expert_parallel=tp > 1)


def run_ep(runner: ModelRunner, adapter_dirs: dict[str, str], family: str) -> dict:
    """run_moe's batch and greedy steps, then mixed_prefill_decode_logits' batch (a prompt's second chunk in it)."""
    results = run_moe(runner, adapter_dirs, LLAMA4_LENGTHS if family == "llama4" else LENGTHS)
    results["mixed"] = [t.numpy() for t in mixed_prefill_decode_logits(runner)[3]]
    return results


def ep_child(rank: int, port: int, families: dict[str, tuple[str, dict[str, str]]], results: mp.Queue) -> None:
    config = ep_config(tp=2)
    by_family = {}
    with tp_group(config, rank, port):
        for family, (model_dir, adapter_dirs) in families.items():
            runner = ModelRunner(config, model_dir, rank, 2, "cpu")
            experts = next(layer.mlp.experts for layer in runner.model.model.layers if hasattr(layer.mlp, "experts"))
            held = [(linear.base.blocks if linear.base.packed else linear.base.weight).shape
                    for linear in (experts.gate_up_proj, experts.down_proj)]  # fmt: skip
            by_family[family] = {**run_ep(runner, adapter_dirs, family), "shapes": tuple(map(tuple, held))}
    results.put((rank, by_family))


def build_families(root: Path) -> dict[str, tuple[str, dict[str, str]]]:
    gpt_oss_dir, gpt_oss_adapters = build_gpt_oss_set(root)
    write_mxfp4(gpt_oss_dir, root / "mxfp4", root / "dequantized")
    sets = {
        "qwen3_moe": build_moe_set(root, "qwen3_moe"),
        "deepseek_v3": build_mla_set(root),
        "gpt_oss_mxfp4": (root / "mxfp4", gpt_oss_adapters),
        "llama4": build_llama4_set(root),
        "gemma4_moe": build_gemma4_set(root, "moe"),
        "glm4_moe": build_glm4_moe_set(root),
    }
    return {family: (str(model_dir), {name: str(path) for name, path in adapters.items()})
            for family, (model_dir, adapters) in sets.items()}  # fmt: skip


def test_moe_ep2_matches_tp1(tmp_path: Path) -> None:
    families = build_families(tmp_path)
    by_rank = run_two_ranks(ep_child, families, timeout_s=600)
    # half of the 4 (DeepSeek-V3, GLM-4.5: 8) experts on each rank, whole: gate_up (E / 2, 2 * intermediate, hidden),
    # down (E / 2, hidden, intermediate); MXFP4 in code bytes, two inputs each
    shapes = {
        "qwen3_moe": ((2, 192, 64), (2, 64, 96)),
        "deepseek_v3": ((4, 64, 64), (4, 64, 32)),
        "gpt_oss_mxfp4": ((2, 128, 32), (2, 64, 32)),
        "llama4": ((2, 96, 64), (2, 64, 48)),
        "gemma4_moe": ((2, 64, 64), (2, 64, 32)),
        "glm4_moe": ((4, 64, 64), (4, 64, 32)),
    }
    for family, (model_dir, adapter_dirs) in families.items():
        tp1 = run_ep(ModelRunner(ep_config(tp=1), model_dir, 0, 1, "cpu"), adapter_dirs, family)
        ours = {rank: by_rank[rank][family] for rank in (0, 1)}
        assert_ranks_match_tp1(ours, tp1, shapes[family])
        for rank in (0, 1):
            for got, ref in zip(ours[rank]["mixed"], tp1["mixed"], strict=True):
                assert abs(got - ref).max() <= 1e-3, (family, rank)
