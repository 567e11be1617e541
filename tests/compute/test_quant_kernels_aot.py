"""The quantized linears' Triton matmuls (kernels/quant_matmul.py) compile for sm_90 and sm_80 without a GPU
(tests/triton_aot.py `quant`): every weight form the worker launches on CUDA (INT4 in groups of 32/64/128, INT8 per
channel and in groups, FP8 per 128×128 block, per tensor and per channel), in bf16 and fp16, at decode batch 1, a
decode batch and a prefill, on a Llama-3-8B layer and the bench model, within each target's shared memory. And the
FP8 kernel's own decoding of e4m3 bytes (sm_80 has no float8 type in Triton) is exact for every byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loraplex.kernels.quant_matmul import fp8_weight_matmul_triton

import tests.triton_aot as triton_aot
from tests.device_helpers import TEST_DEVICE  # conftest has set TRITON_INTERPRET where no GPU is used

ARCHS = (90, 80)


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    # A process of its own: this one runs the kernels in the interpreter, which cannot compile them.
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "triton_aot.py"), "quant"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_every_form_compiles_for_sm90_and_sm80_within_shared_memory(compiled: list[dict]) -> None:
    configs = {(m, f, d) for m in triton_aot.QUANT_SHAPES for f in triton_aot.QUANT_FORMS
               for d in triton_aot.QUANT_DTYPES}  # fmt: skip
    assert {(r["arch"], r["model"], r["form"], r["dtype"]) for r in compiled} == {(a, *c) for a in ARCHS
                                                                                 for c in configs}  # fmt: skip
    assert len(compiled) == len(ARCHS) * len(configs)
    for r in compiled:
        where = f"sm_{r['arch']} {r['model']} {r['form']} {r['dtype']}"
        num_shapes = len(triton_aot.QUANT_SHAPES[r["model"]])
        assert r["launches"] == num_shapes * len(triton_aot.QUANT_TOKENS), where
        # batch 1, a multiple of 16 and neither are three specializations of the token count
        assert len(r["compiled"]) >= len(triton_aot.QUANT_TOKENS), where
        for c in r["compiled"]:
            assert c["kernel"] == r["kernel"] and c["arch"] == r["arch"], where
            assert 0 < c["shared_bytes"] <= triton_aot.SHARED_LIMIT[r["arch"]], (where, c["shared_bytes"])


def test_both_targets_compile_the_same_specializations(compiled: list[dict]) -> None:
    keys = {}
    for r in compiled:
        keys.setdefault((r["model"], r["form"], r["dtype"]), {})[r["arch"]] = {c["key"] for c in r["compiled"]}
    for config, by_arch in keys.items():
        assert by_arch[90] == by_arch[80], config


def test_fp8_kernel_decodes_every_e4m3_byte_exactly() -> None:
    # One column per non-NaN byte, read back through one-hot rows of x: each value times its row's scale, exactly,
    # subnormals and negative values included.
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    q = values[~values.float().isnan()].reshape(1, -1).repeat(3, 1).contiguous()  # (3, 254)
    num_cols = q.shape[1]
    scales = torch.tensor([[1.0], [0.37], [3e-3]])
    args = [t.to(TEST_DEVICE) for t in (torch.eye(num_cols), q, scales, torch.arange(3),
                                        torch.zeros(num_cols, dtype=torch.int64))]  # fmt: skip
    out = fp8_weight_matmul_triton(*args)  # (254, 3): row i holds column i's three scaled values
    assert torch.equal(out.cpu(), q.float().t() * scales.t())
