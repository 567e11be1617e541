"""LoRA compute. The worker uses one backend object (kernels/backend.py: `select_backend`), chosen at start-up; the
checked Triton launchers `*_triton` are the same products from tensors alone, for tests and scripts (their torch
references live in tests/kernel_refs.py). kernels/ imports nothing of ours (tests/unit/test_package_boundaries.py).

backend.py          LoRABackend: the one object, chosen at start-up (--lora-backend), that does every LoRA product
checks.py           the argument contract the torch reference and the Triton launchers share
lora_shrink.py      segmented LoRA shrink (x · Aᵀ per slot segment) in Triton, and its checked launcher
lora_expand.py      segmented LoRA expand (· Bᵀ, scaled, added to y) in Triton, and its checked launcher
segment_tiles.py    the row-tile numbering over segments both LoRA kernels rebuild in-kernel
lora_torch.py       the CPU serving path and the oracle for the Triton kernels, in torch ops
cpu_ext.py          builds and loads the AVX-512 BF16 CPU kernels (csrc/)
cpu_gemv.py         the CPU linears' kernels and weight layouts (csrc/gemv_avx512.cpp, else gemv_avx2.cpp)
cpu_build.py        what both share: the CPU flags they need, and building each once per process
paged_attention.py  paged attention in Triton, reading keys and values from their cache pages in place
latent_attention.py  paged latent attention (DeepSeek-V3's [latent | rope key] rows, one KV head) in Triton
quant_matmul.py     weight-only quantized matmul in Triton, dequantized tile by tile
moe_matmul.py       the experts' grouped matmul over expert-sorted rows in Triton (plain or MXFP4), no host reads
mxfp4_matmul.py     one expert's MXFP4 (gpt-oss) matmul in Triton, e2m1 codes and e8m0 scales decoded in the tile
rms_norm.py         RMSNorm with the pre-norm residual add fused in, in Triton
rotary.py           rotary position embedding in Triton, in place on q and k
silu_mul.py         SiLU-and-multiply of a fused [gate | up] projection in Triton
gated_delta.py      Gated DeltaNet's causal conv and gated delta rule in Triton, states by slot, a batch per launch
aot.py              ahead-of-time compilation of the Triton LoRA kernels for a GPU architecture
progress.py         progress of long start-up work (kernel builds, warm-ups; the worker's checkpoint loading too)
"""

from __future__ import annotations

from loraplex.kernels import cpu_ext
from loraplex.kernels.backend import BACKENDS, BackendError, LoRABackend, LoRABatchMeta, select_backend
from loraplex.kernels.lora_expand import lora_expand_triton
from loraplex.kernels.lora_shrink import lora_shrink_triton

__all__ = [
    "BACKENDS",
    "BackendError",
    "LoRABackend",
    "LoRABatchMeta",
    "cpu_ext",
    "lora_expand_triton",
    "lora_shrink_triton",
    "select_backend",
]
