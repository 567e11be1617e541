"""The compiled CPU kernels (kernels/cpu_ext) inside a bfloat16 worker: decode steps with adapters and base rows,
through paged decode attention, the LoRA shrink/expand, RMSNorm and SiLU-and-multiply, against the same model in
float32. The kernels must be
used, and be as close to float32 as the torch ops they replace."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from loraplex.kernels import cpu_ext, cpu_gemv
from loraplex.protocol.adapters.lora_targets import TARGET_MODULES
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, SlotLoad
from loraplex.worker.layers import packed
from loraplex.worker.model_runner import ModelRunner

from tests.builders import build_lora_adapter
from tests.lora_helpers import build_peft_adapter
from tests.worker_helpers import GREEDY, build_llama_variant, forward_logits, make_runner, random_prompts

OFF = cpu_ext.unavailable_reason()
pytestmark = pytest.mark.skipif(OFF is not None, reason=f"CPU kernels cannot run here: {OFF}")

# head_dim 64 and 2 query heads per KV head: shapes decode_attention is built for
MODEL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384)
ADAPTERS = {"r8": (8, 1), "r16": (16, 2), "r4": (4, 3)}  # name -> (rank, seed)
ROW_ADAPTERS = ["r8", "r8", None, "r16", "r4", "r16", None, "r8"]  # sorted by slot, as the scheduler sends them
PROMPT_LENGTHS = [9, 30, 5, 17, 40, 3, 22, 12]
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("cpu-kernels")
    build_llama_variant(root / "base", **MODEL)
    adapters = {}
    for name, (rank, seed) in ADAPTERS.items():
        adapters[name] = root / name
        build_lora_adapter(root / "base", adapters[name], r=rank, lora_alpha=2 * rank,
                           target_modules=TARGET_MODULES, seed=seed)  # fmt: skip
    return root / "base", adapters


def run_decode(runner: ModelRunner, adapters: dict[str, Path]) -> torch.Tensor:
    """Prefill, then DECODE_STEPS steps feeding fixed tokens; (steps, reqs, vocab) float32 logits of the decodes."""
    specs = [AdapterToLoad(lora_name=n, lora_path=str(p), lora_id=i + 1) for i, (n, p) in enumerate(adapters.items())]
    assert all(r.success for r in runner.lora.load(specs))
    slot = {name: i for i, name in enumerate(adapters)}
    loads = [SlotLoad(slot=i, lora_id=i + 1) for i in range(len(adapters))]
    prompts = random_prompts(PROMPT_LENGTHS, runner.vocab_size, seed=5)
    free_pages = list(range(runner.kv_cache.num_pages))
    random.Random(0).shuffle(free_pages)  # scattered page tables
    pages = [[free_pages.pop() for _ in range(-(-(len(p) + DECODE_STEPS) // runner.page_size))] for p in prompts]
    slots = [-1 if name is None else slot[name] for name in ROW_ADAPTERS]
    prefill = [ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=s)
               for p, pg, s in zip(prompts, pages, slots, strict=True)]  # fmt: skip
    runner.forward(ForwardBatch(batch_id=0, reqs=prefill, slot_loads=loads))
    steps = []
    for step in range(DECODE_STEPS):
        reqs = [ForwardReq(input_ids=[(7 * i + step) % runner.vocab_size], num_cached_tokens=len(p) + step,
                           page_ids=pg, sampling=GREEDY, num_generated=step + 1, slot=s)
                for i, (p, pg, s) in enumerate(zip(prompts, pages, slots, strict=True))]  # fmt: skip
        steps.append(forward_logits(runner, ForwardBatch(batch_id=1 + step, reqs=reqs)).float())
    return torch.stack(steps)


class _CountingKernels:
    def __init__(self, module):
        self.module, self.calls = module, {}

    def __getattr__(self, name: str):
        function = getattr(self.module, name)

        def counted(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return function(*args)

        return counted


def test_bf16_decode_with_cpu_kernels_matches_fp32(
    model_dirs: tuple[Path, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    base_dir, adapters = model_dirs
    config = dict(enable_lora=True, max_lora_rank=16, lora_target_modules=["all"], max_loras_per_batch=4)
    reference = run_decode(make_runner(base_dir, dtype="float32", **config), adapters)

    counting = _CountingKernels(cpu_ext.kernels())
    monkeypatch.setattr(cpu_ext, "kernels", lambda: counting)
    with_kernels = run_decode(make_runner(base_dir, dtype="bfloat16", **config), adapters)
    num_layers = 2
    assert counting.calls["decode_attention"] == DECODE_STEPS * num_layers
    # 4 fused linears per layer, in every decode step and in the prefill (whose short prompts are short segments):
    # each one call for shrink and expand together (TP=1: nothing to reduce in between)
    num_forwards = 1 + DECODE_STEPS
    assert counting.calls["shrink_expand"] == num_forwards * num_layers * 4
    assert "shrink" not in counting.calls and "expand" not in counting.calls
    assert counting.calls["rms_norm"] == num_forwards * (2 * num_layers + 1)  # two per layer and the final norm
    assert counting.calls["silu_and_mul"] == num_forwards * num_layers

    monkeypatch.setattr(cpu_ext, "kernels", lambda: None)
    with_torch_ops = run_decode(make_runner(base_dir, dtype="bfloat16", **config), adapters)

    kernels_error = (with_kernels - reference).abs().max().item()
    torch_ops_error = (with_torch_ops - reference).abs().max().item()
    logit_range = (reference.max() - reference.min()).item()
    assert kernels_error <= 1.5 * torch_ops_error + 1e-3 * logit_range, (kernels_error, torch_ops_error, logit_range)


@pytest.mark.parametrize("layout", ["onednn", "blocked"])
@pytest.mark.parametrize("tied", [False, True])
def test_packed_weights_match_plain_weights(
    model_dirs: tuple[Path, dict[str, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tied: bool, layout: str
) -> None:
    # bfloat16 on the CPU: every linear's weight is reordered once, for oneDNN (LORAPLEX_CPU_GEMV=off) or into
    # cpu_gemv's blocked layout (the default with AVX-512 BF16), and the plain copy freed; the logits must be those of
    # the plain weights. A tied LM head keeps the embedding's weight, plain.
    if layout == "blocked" and cpu_gemv.isa() is not cpu_gemv.AVX512:
        pytest.skip("the blocked layout is the AVX-512 BF16 build's")
    monkeypatch.setenv("LORAPLEX_CPU_GEMV", "auto" if layout == "blocked" else "off")
    base_dir, adapters = model_dirs
    if tied:
        base_dir = tmp_path / "tied"
        build_llama_variant(base_dir, **MODEL, tie_word_embeddings=True)
    config = dict(enable_lora=True, max_lora_rank=16, lora_target_modules=["all"], max_loras_per_batch=4)
    runner = make_runner(base_dir, dtype="bfloat16", **config)
    decoder_linears = [m for m in runner.model.model.layers.modules() if hasattr(m, "packed_weight")]
    assert len(decoder_linears) == 4 * runner.model_config.num_layers
    lm_head = runner.model.lm_head
    lm_head = getattr(lm_head, "base", lm_head)  # under the module copies' wrapper (CopyLMHead) where LoRA is on
    for module in [*decoder_linears, lm_head]:
        is_packed = not getattr(module, "tied", False)
        if layout == "onednn":
            assert (module.packed_weight is not None) == is_packed and module.gemv is None
        else:  # a tied head is laid out too, beside the embedding's plain weight
            assert module.packed_weight is None and module.gemv.blocked
        assert (module.weight.numel() == 0) == is_packed  # the plain copy is freed once packed
    with_packed = run_decode(runner, adapters)

    monkeypatch.setenv("LORAPLEX_CPU_GEMV", "off")
    monkeypatch.setattr(packed, "unavailable_reason", lambda device, dtype: "off for this test")
    plain = make_runner(base_dir, dtype="bfloat16", **config)
    assert all(m.packed_weight is None for m in plain.model.modules() if hasattr(m, "packed_weight"))
    torch.testing.assert_close(with_packed, run_decode(plain, adapters), atol=1e-2, rtol=1e-2)
    if not tied:
        # a DoRA adapter's row norms: the packed runner read its ‖W‖² before packing and its cross terms through the
        # packed layers; the plain runner reads both from the plain weights
        dora_dir = tmp_path / "dora"
        build_peft_adapter(base_dir, dora_dir, r=8, lora_alpha=16, target_modules=TARGET_MODULES, seed=4,
                           use_dora=True)  # fmt: skip
        ours, ref = dora_norms_sq(runner, dora_dir), dora_norms_sq(plain, dora_dir)
        assert ours.keys() == ref.keys() and len(ours) == len(TARGET_MODULES) * runner.model_config.num_layers
        for key, norms_sq in ours.items():
            torch.testing.assert_close(norms_sq, ref[key], atol=0, rtol=2e-2, msg=str(key))


def dora_norms_sq(runner: ModelRunner, adapter_dir: Path) -> dict:
    [outcome] = runner.lora.load([AdapterToLoad(lora_name="dora", lora_path=str(adapter_dir), lora_id=9)])
    assert outcome.success, outcome.error_message
    return runner.lora.adapters[9].dora.norms_sq


def test_weights_are_packed_only_for_bfloat16_on_cpu() -> None:
    assert packed.unavailable_reason(torch.device("cpu"), torch.bfloat16) is None
    assert "float32" in packed.unavailable_reason(torch.device("cpu"), torch.float32)
