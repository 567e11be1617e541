"""The device the tests compute on, decided once before anything imports Triton (conftest imports this first).

LORAPLEX_TEST_DEVICE=cuda|cpu picks it; by default CUDA where it is available. Without a GPU the Triton kernels run in
Triton's interpreter (TRITON_INTERPRET=1: slow, and wrong for bfloat16 dots, so the kernel tests use fp32 and fp16);
with one they are compiled, and the interpreter is switched off even if the environment asked for it."""

from __future__ import annotations

import os

import torch

TEST_DEVICE = torch.device(os.environ.get("LORAPLEX_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
USES_GPU = TEST_DEVICE.type == "cuda"


def configure_triton() -> None:
    if USES_GPU:
        os.environ["TRITON_INTERPRET"] = "0"
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
