"""The model's kernels are chosen once, at start-up, and bound when each layer is built: a worker on the CPU kernels
holds their ops in every norm and activation and the `cpu` attention backend; a torch-ops worker holds torch ops and
SDPA; and the model code never asks which backend runs. (The Triton ops, CUDA's:
tests/compute/test_fused_kernels.py.)"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from loraplex.kernels import cpu_ext
from loraplex.worker.layers import activation, attention, norm, rotary
from loraplex.worker.layers.activation import SiluAndMul
from loraplex.worker.layers.attention import CPUAttention, SDPAAttention
from loraplex.worker.layers.norm import RMSNorm
from loraplex.worker.layers.ops import CPUKernelOps, TorchOps, current_ops, model_ops
from loraplex.worker.model import gemma2, gemma3, llama
from loraplex.worker.model_runner import ModelRunner

from tests.worker_helpers import build_llama_variant, make_runner

OFF = cpu_ext.unavailable_reason()
needs_cpu_kernels = pytest.mark.skipif(OFF is not None, reason=f"CPU kernels cannot run here: {OFF}")
# head_dim 64 and 2 query heads per KV head: shapes the CPU decode attention takes
# what a backend check in model code would have to name
BACKEND_WORDS = ("cpu_kernels", "decode_kernels", "use_cpu_kernels", "hasattr", "backend", "cpu_ext", ".device.type")
CPU_KERNEL_MODEL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384)


def _op_layers(runner: ModelRunner) -> list[torch.nn.Module]:
    layers = [m for m in runner.model.modules() if isinstance(m, RMSNorm | SiluAndMul)]
    num_layers = runner.model_config.num_layers
    assert len(layers) == 3 * num_layers + 1  # two norms and an activation per layer, and the final norm
    return layers


def test_torch_ops_model_holds_torch_ops(llama_dir: Path) -> None:
    runner = make_runner(llama_dir)  # float32 on the CPU: no CPU kernels
    assert runner.backend.cpu_kernels is None
    assert all(type(layer.ops) is TorchOps for layer in _op_layers(runner))
    assert type(runner.attention) is SDPAAttention


@needs_cpu_kernels
def test_cpu_kernel_model_holds_cpu_ops(tmp_path: Path) -> None:
    build_llama_variant(tmp_path, **CPU_KERNEL_MODEL)
    runner = make_runner(tmp_path, dtype="bfloat16")  # auto: the CPU kernels
    compiled = runner.backend.cpu_kernels
    assert runner.backend.name == "cpu" and compiled is not None
    layers = _op_layers(runner)
    assert all(type(layer.ops) is CPUKernelOps and layer.ops.compiled is compiled for layer in layers)
    assert len({id(layer.ops) for layer in layers}) == 1  # one object, picked once
    assert type(runner.attention) is CPUAttention and runner.attention.compiled is compiled

    # the same model under the torch LoRA backend: torch ops everywhere, SDPA for every group
    torch_runner = make_runner(tmp_path, dtype="bfloat16", lora_backend="torch")
    assert all(type(layer.ops) is TorchOps for layer in _op_layers(torch_runner))
    assert type(torch_runner.attention) is SDPAAttention


def test_layers_read_the_ops_once_when_built() -> None:
    fake = CPUKernelOps(compiled=None)
    with model_ops(fake):
        inside = RMSNorm(8, 1e-6), SiluAndMul()
    outside = RMSNorm(8, 1e-6)
    assert all(layer.ops is fake for layer in inside)
    assert type(outside.ops) is TorchOps and current_ops() is outside.ops


def test_model_code_never_asks_which_backend_runs() -> None:
    for module in (llama, gemma2, gemma3, norm, activation, rotary):
        source = inspect.getsource(module)
        for word in BACKEND_WORDS:
            assert word not in source, (module.__name__, word)
    # attention reaches the model through the batch's metadata object alone (and the layer's own scale, window, cap;
    # an FP8 cache's scales travel with the cache's layer)
    assert list(inspect.signature(attention.paged_attention).parameters) == ["q", "k", "v", "k_cache", "v_cache",
                                                                              "inputs", "layer", "scales"]  # fmt: skip
    assert "hasattr" not in inspect.getsource(ModelRunner)
