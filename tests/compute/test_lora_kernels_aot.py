"""Every kind of Triton LoRA kernel variant compiles for sm_90 and sm_80 without a GPU (kernels/aot.py, Triton's own
ptxas), and the PTX shows the memory access the kernels are written for: 16-byte vector loads and stores in the expand
where the slice bounds are 8-column aligned (2-byte ones where they are not), 16-byte async copies in the shrink."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from loraplex.kernels.aot import TARGETS, variants

from tests.server_utils import REPO_ROOT


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    # A process of its own: this one runs the kernels in the interpreter, which cannot compile them.
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-m", "loraplex.kernels.aot", "--json"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_every_variant_compiles_for_each_target(compiled: list[dict]) -> None:
    assert len(compiled) == len(TARGETS) * len(variants())
    failed = [(r["arch"], r["kernel"], r["dtype"], r["error"]) for r in compiled if not r["ok"]]
    assert not failed
    assert {r["arch"] for r in compiled} == set(TARGETS)


def test_memory_access_in_the_ptx(compiled: list[dict]) -> None:
    for r in compiled:
        where = (r["arch"], r["kernel"], r["dtype"], r["block_m"], r["block_r"], r["h_dtype"], r["col_align"])
        if r["kernel"] == "shrink":
            assert r["async_copies"] > 0, where
        elif r["col_align"] == 8:
            assert r["vector_loads"] > 0 and r["vector_stores"] > 0, where
            if r["h_dtype"] == "float32":  # the serving path: y and B are the only 16-bit tensors, all vector access
                assert r["scalar_16bit_loads"] == 0, where
        else:
            assert r["vector_loads"] == 0, where
            if r["dtype"] != "float32":
                assert r["scalar_16bit_loads"] > 0, where
