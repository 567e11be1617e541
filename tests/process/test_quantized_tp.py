"""Quantized bases under tensor parallelism: two gloo ranks, each holding its shard of the packed weights, scales,
zero points and act-order indices, serving one batch of the base and five adapters must reproduce tp=1."""

from __future__ import annotations

from pathlib import Path

import pytest
from loraplex.worker.model_runner import ModelRunner

from tests.process.test_lora_tp import MIXED, run_lora, run_tp2, tp_config
from tests.quantize_checkpoint import write_quantized

# act-order groups scattered over the row-parallel shards; AWQ's interleaved packing split by columns; an INT8
# per-channel zero point; FP8 128x128 blocks that a 64-wide projection and its shards only partly fill
TP_FORMATS = ("gptq-4bit-act-order", "awq-4bit", "ct-w8a16", "ct-fp8-block")


@pytest.mark.parametrize("fmt", TP_FORMATS)
def test_quantized_tp2_matches_tp1(fmt: str, llama_dir: Path, adapter_dirs: dict[str, Path], tmp_path: Path) -> None:
    quant_dir = tmp_path / fmt
    write_quantized(llama_dir, fmt, quant_dir, tmp_path / "dequantized")
    dirs = {name: str(path) for name, path in adapter_dirs.items()}
    by_rank = run_tp2(str(quant_dir), dirs)
    tp1 = run_lora(ModelRunner(tp_config(tp=1), str(quant_dir), 0, 1, "cpu"), dirs)
    for rank in (0, 1):
        for name, ours, ref in zip(MIXED, by_rank[rank]["logits"], tp1["logits"], strict=True):
            diff = abs(ours - ref).max()
            assert diff <= 1e-4, (fmt, rank, name, diff)
        assert by_rank[rank]["greedy"] == tp1["greedy"], (fmt, rank)
