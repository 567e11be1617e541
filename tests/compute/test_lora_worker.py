"""Multi-LoRA in the worker against HF transformers + peft: one batch mixing the base model and five adapters
(ranks 4 to 64, different target sets, rsLoRA), slot reuse, Qwen2's qkv bias, and the Triton kernels."""

from __future__ import annotations

from pathlib import Path

import loraplex.kernels.backend as lora_backend
import pytest
from loraplex.kernels import select_backend
from loraplex.protocol.adapters.lora_targets import TARGET_MODULES
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, SlotLoad
from loraplex.worker.batch_inputs import BatchError
from loraplex.worker.lora.layers import LoRALinear
from loraplex.worker.model_runner import ModelRunner

from tests.builders import build_lora_adapter
from tests.device_helpers import USES_GPU
from tests.lora_helpers import (
    ADAPTER_IDS,
    LORA_CONFIG,
    MIXED,
    MIXED_LENGTHS,
    batch_logits,
    greedy_decode,
    load_all,
    slot_loads,
    slot_of,
    use_lora_backend,
)
from tests.reference import (
    assert_greedy_matches_peft,
    assert_logits_match_peft,
    hf_logits,
)
from tests.worker_helpers import (
    GREEDY,
    PAGE_SIZE,
    consecutive_pages,
    forward_logits,
    make_runner,
    prefill_logits,
    random_prompts,
)

FP32_TOL = 1e-4
DECODE_STEPS = 6
MIN_ADAPTER_EFFECT = 0.1  # every adapter must move the logits by more than this: a no-op LoRA fails the tests


@pytest.fixture(scope="module")
def runner(llama_dir: Path, adapter_dirs: dict[str, Path]) -> ModelRunner:
    runner = make_runner(llama_dir, **LORA_CONFIG)
    load_all(runner, adapter_dirs)
    return runner


def one_req(prompt: list[int], slot: int, first_page: int = 0) -> ForwardReq:
    page_ids = list(range(first_page, first_page + -(-len(prompt) // PAGE_SIZE)))
    return ForwardReq(input_ids=prompt, num_cached_tokens=0, page_ids=page_ids, sampling=GREEDY, slot=slot)


def test_pool_covers_the_model(runner: ModelRunner) -> None:
    layer = runner.model.model.layers[0]
    wrapped = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    assert all(isinstance(m, LoRALinear) for m in wrapped)
    pool = runner.lora.pool
    assert pool.num_slots == 6
    a, b = pool.buffers[(0, "self_attn.qkv_proj")].lora_a, pool.buffers[(0, "self_attn.qkv_proj")].lora_b
    assert tuple(a.shape) == (6, 3 * 64, 64) and tuple(b.shape) == (6, 64, 64 + 32 + 32)


def test_mixed_batch_matches_peft(runner: ModelRunner, llama_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    prompts = random_prompts(MIXED_LENGTHS, runner.vocab_size, seed=11)
    ours = batch_logits(runner, prompts, MIXED)
    max_diffs = assert_logits_match_peft(ours, prompts, MIXED, llama_dir, adapter_dirs, FP32_TOL, MIN_ADAPTER_EFFECT)
    print("max abs logit diff vs HF/peft:", {k: f"{v:.1e}" for k, v in max_diffs.items()})

    outputs = greedy_decode(runner, prompts, MIXED, steps=DECODE_STEPS)
    assert_greedy_matches_peft(outputs, prompts, MIXED, llama_dir, adapter_dirs, DECODE_STEPS)


def test_decode_step_sorted_by_slot_matches_peft(
    runner: ModelRunner, llama_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    # One decode token per request, sorted by slot as the scheduler sends them: the CPU path runs these segments as
    # one group over the pool's slot range (one matmul per linear, not one per segment), and must still match peft.
    names = [None, "a4", "a8", "a16", "a32", "a64"]
    prompts = random_prompts([6, 7, 5, 9, 4, 8], runner.vocab_size, seed=23)
    next_tokens = [3, 17, 42, 5, 99, 64]
    pages = consecutive_pages([len(p) + 1 for p in prompts], PAGE_SIZE)  # room for the decode token
    prefill = [
        ForwardReq(input_ids=p, num_cached_tokens=0, page_ids=pg, sampling=GREEDY, slot=slot_of(n))
        for p, pg, n in zip(prompts, pages, names, strict=True)
    ]
    runner.forward(ForwardBatch(batch_id=0, reqs=prefill, slot_loads=slot_loads(names)))
    decode_reqs = [
        ForwardReq(input_ids=[t], num_cached_tokens=len(p), page_ids=pg, sampling=GREEDY, slot=slot_of(n))
        for p, pg, n, t in zip(prompts, pages, names, next_tokens, strict=True)
    ]
    logits = forward_logits(runner, ForwardBatch(batch_id=1, reqs=decode_reqs))  # (reqs, vocab)
    plan = runner.lora.batch.meta.plan  # the torch backend's, made once for the step
    assert len(plan.groups) == 1 and not plan.separate, "the decode step was not one grouped matmul"
    for prompt, name, token, row in zip(prompts, names, next_tokens, logits, strict=True):
        ref = hf_logits(llama_dir, prompt + [token], None if name is None else adapter_dirs[name])[-1]
        diff = (row - ref).abs().max().item()
        assert diff <= FP32_TOL, f"{name or 'base'}: max abs logit diff {diff:.2e}"


def test_slot_reuse_leaves_nothing_stale(runner: ModelRunner, llama_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    # all seven modules at r64, then q+v at r32, then MLP-only at r8, all in slot 5: anything left over shows.
    prompt = random_prompts([9], runner.vocab_size, seed=12)[0]
    for name in ("a64", "a32", "a8"):
        batch = ForwardBatch(
            batch_id=0, reqs=[one_req(prompt, 5)], slot_loads=[SlotLoad(slot=5, lora_id=ADAPTER_IDS[name])]
        )
        diff = (forward_logits(runner, batch) - hf_logits(llama_dir, prompt, adapter_dirs[name])).abs().max().item()
        assert diff <= FP32_TOL, (name, diff)
    assert runner.lora.slot_lora_ids[5] == ADAPTER_IDS["a8"]


def test_drop_and_clear_fail_batches_not_the_runner(
    runner: ModelRunner, llama_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    lora = runner.lora
    spec = AdapterToLoad(lora_name="copy", lora_path=str(adapter_dirs["a16"]), lora_id=50)
    assert lora.load([spec])[0].success
    prompt = random_prompts([6], runner.vocab_size, seed=13)[0]
    loads = [SlotLoad(slot=5, lora_id=50)]
    forward_logits(runner, ForwardBatch(batch_id=0, reqs=[one_req(prompt, 5)], slot_loads=loads))
    lora.drop([50])
    assert lora.slot_lora_ids[5] == -1 and 50 not in lora.adapters
    with pytest.raises(BatchError, match="slot 5, which holds no adapter"):
        forward_logits(runner, ForwardBatch(batch_id=1, reqs=[one_req(prompt, 5)]))
    with pytest.raises(BatchError, match="adapter id 50 .* not loaded"):
        runner.forward(ForwardBatch(batch_id=2, reqs=[], slot_loads=[SlotLoad(slot=5, lora_id=50)]))
    with pytest.raises(BatchError, match="outside 0..5"):
        runner.forward(ForwardBatch(batch_id=3, reqs=[], slot_loads=[SlotLoad(slot=6, lora_id=1)]))
    # lora_id -1 empties a slot.
    runner.forward(ForwardBatch(batch_id=4, reqs=[], slot_loads=[SlotLoad(slot=5, lora_id=ADAPTER_IDS["a4"])]))
    runner.forward(ForwardBatch(batch_id=5, reqs=[], slot_loads=[SlotLoad(slot=5, lora_id=-1)]))
    with pytest.raises(BatchError, match="holds no adapter"):
        forward_logits(runner, ForwardBatch(batch_id=6, reqs=[one_req(prompt, 5)]))
    # Still serving, and correct.
    batch = ForwardBatch(batch_id=7, reqs=[one_req(prompt, 5)], slot_loads=[SlotLoad(slot=5, lora_id=3)])
    diff = (forward_logits(runner, batch) - hf_logits(llama_dir, prompt, adapter_dirs["a16"])).abs().max().item()
    assert diff <= FP32_TOL


def test_drop_before_install_keeps_nothing(runner: ModelRunner, adapter_dirs: dict[str, Path]) -> None:
    # A load that timed out on this rank is rolled back (drop) before its slow read finishes: the install that
    # follows must keep nothing and say so, and other ids are unaffected.
    lora = runner.lora
    late = AdapterToLoad(lora_name="late", lora_path=str(adapter_dirs["a8"]), lora_id=60)
    other = AdapterToLoad(lora_name="other", lora_path=str(adapter_dirs["a8"]), lora_id=61)
    read = lora.read([late, other])
    assert all(not isinstance(r, Exception) for r in read)
    lora.drop([60])
    dropped, kept = lora.install([late, other], read)
    assert not dropped.success and dropped.lora_id == 60
    assert "dropped while it loaded" in dropped.error_message
    assert kept.success and kept.lora_id == 61
    assert 60 not in lora.adapters and 61 in lora.adapters
    with pytest.raises(BatchError, match="adapter id 60 .* not loaded"):
        runner.forward(ForwardBatch(batch_id=0, reqs=[], slot_loads=[SlotLoad(slot=5, lora_id=60)]))
    # The same through load(): drop first, then the whole load.
    lora.drop([62])
    [result] = lora.load([AdapterToLoad(lora_name="later", lora_path=str(adapter_dirs["a4"]), lora_id=62)])
    assert not result.success and 62 not in lora.adapters
    lora.drop([61])
    assert 61 not in lora.adapters


def test_base_only_batches_launch_no_lora_work(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    for op in ("prepare", "shrink", "expand", "shrink_expand"):
        monkeypatch.setattr(runner.backend, op, lambda *args, op=op: calls.append(op))
    prompt = random_prompts([5], runner.vocab_size, seed=14)[0]
    base = prefill_logits(runner, prompt)
    assert calls == []
    prefill_logits(runner, prompt)  # and the same on a second call
    assert calls == [] and base.shape == (5, runner.vocab_size)


def test_qwen2_adapter_matches_peft(qwen2_dir: Path, tmp_path: Path) -> None:
    adapter_dir = tmp_path / "q8"
    build_lora_adapter(qwen2_dir, adapter_dir, r=8, lora_alpha=16, target_modules=TARGET_MODULES, seed=21)
    runner = make_runner(qwen2_dir, **{**LORA_CONFIG, "max_lora_rank": 8})
    assert runner.lora.load([AdapterToLoad(lora_name="q8", lora_path=str(adapter_dir), lora_id=1)])[0].success
    prompts = random_prompts([7, 5], runner.vocab_size, seed=15)
    reqs = [one_req(prompts[0], -1), one_req(prompts[1], 0, first_page=10)]
    logits = forward_logits(runner, ForwardBatch(batch_id=0, reqs=reqs, slot_loads=[SlotLoad(slot=0, lora_id=1)]))
    base, adapted = logits.split([7, 5])
    assert (base - hf_logits(qwen2_dir, prompts[0], None)).abs().max().item() <= FP32_TOL
    ref = hf_logits(qwen2_dir, prompts[1], adapter_dir)
    assert (adapted - ref).abs().max().item() <= FP32_TOL
    assert (ref - hf_logits(qwen2_dir, prompts[1], None)).abs().max().item() > MIN_ADAPTER_EFFECT


@pytest.mark.skipif(USES_GPU, reason="this runner is on the CPU; test_lora_backends runs Triton on the GPU")
def test_triton_kernels_match_torch_path(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    names = [None, "a16", "a32", "a16"]
    prompts = random_prompts([3, 4, 2, 1], runner.vocab_size, seed=16)
    torch_path = batch_logits(runner, prompts, names)
    calls = []
    real = lora_backend.launch_shrink
    monkeypatch.setattr(lora_backend, "launch_shrink", lambda *args: calls.append(1) or real(*args))
    torch_backend = runner.backend
    use_lora_backend(runner, select_backend("triton", runner.device, runner.dtype))  # the interpreter (conftest)
    try:
        triton_path = batch_logits(runner, prompts, names)
    finally:
        use_lora_backend(runner, torch_backend)
    assert calls, "the Triton kernels did not run"
    for ours, ref in zip(triton_path, torch_path, strict=True):
        assert (ours - ref).abs().max().item() <= FP32_TOL


def test_slots_refused_without_lora(llama_dir: Path) -> None:
    runner = make_runner(llama_dir)
    assert runner.lora is None
    prompt = random_prompts([4], runner.vocab_size, seed=17)[0]
    with pytest.raises(BatchError, match="LoRA is not enabled"):
        forward_logits(runner, ForwardBatch(batch_id=0, reqs=[one_req(prompt, 0)]))
    with pytest.raises(BatchError, match="LoRA is not enabled"):
        runner.forward(ForwardBatch(batch_id=1, reqs=[], slot_loads=[SlotLoad(slot=0, lora_id=1)]))
