"""Adapter validation: every invalid adapter is refused with a message naming the cause and an error kind, adds
nothing, and the manager keeps serving. The pool here covers attention only, up to rank 16."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from loraplex.protocol.adapters.lora_targets import ATTN_MODULES
from loraplex.protocol.structs import AdapterToLoad, ForwardBatch, ForwardReq, SlotLoad
from loraplex.worker.lora.adapter import AdapterLoadError, _finite_in_dtype, _map_safetensors, load_adapter
from loraplex.worker.model_runner import ModelRunner
from safetensors.torch import load_file, save_file

from tests.builders import build_lora_adapter, build_tiny_model
from tests.worker_helpers import GREEDY, forward_logits, make_runner, random_prompts

A4_ID = 1
NEXT_ID = iter(range(100, 1000))


@pytest.fixture(scope="module")
def runner(llama_dir: Path, adapter_dirs: dict[str, Path]) -> ModelRunner:
    runner = make_runner(
        llama_dir, enable_lora=True, max_lora_rank=16, lora_target_modules=list(ATTN_MODULES), max_loras_per_batch=2
    )
    result = runner.lora.load([AdapterToLoad(lora_name="a4", lora_path=str(adapter_dirs["a4"]), lora_id=A4_ID)])
    assert result[0].success, result[0].error_message
    return runner


@pytest.fixture(scope="module")
def other_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Adapters built for other base models: another hidden size, one layer more."""
    root = tmp_path_factory.mktemp("other_bases")
    out = {}
    for kind, kwargs in {"hidden32": dict(hidden_size=32), "layers3": dict(num_layers=3)}.items():
        build_tiny_model(root / kind, with_tokenizer=False, **kwargs)
        out[kind] = root / f"{kind}_adapter"
        build_lora_adapter(root / kind, out[kind], r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=7)
    return out


def a4_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    req = ForwardReq(input_ids=prompt, num_cached_tokens=0, page_ids=[0, 1, 2], sampling=GREEDY, slot=1)
    return forward_logits(runner, ForwardBatch(batch_id=0, reqs=[req], slot_loads=[SlotLoad(slot=1, lora_id=A4_ID)]))


def edit_config(**changes) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        config = json.loads((path / "adapter_config.json").read_text())
        config.update(changes)
        (path / "adapter_config.json").write_text(json.dumps(config))

    return edit


def drop_field(field: str) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        config = json.loads((path / "adapter_config.json").read_text())
        del config[field]
        (path / "adapter_config.json").write_text(json.dumps(config))

    return edit


def drop_tensor(suffix: str) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        tensors = load_file(path / "adapter_model.safetensors")
        save_file({k: v for k, v in tensors.items() if not k.endswith(suffix)}, path / "adapter_model.safetensors")

    return edit


def poison_tensor(suffix: str, value: float) -> Callable[[Path], None]:
    def edit(path: Path) -> None:
        tensors = load_file(path / "adapter_model.safetensors")
        key = next(k for k in tensors if k.endswith(suffix))
        tensors[key][0, 0] = value
        save_file(tensors, path / "adapter_model.safetensors")

    return edit


def write(name: str, content: str) -> Callable[[Path], None]:
    return lambda path: (path / name).write_text(content)


# case -> (how to build it from a copy of a4, or the name of another adapter; message fragments; error kind)
CASES: dict[str, tuple[Callable[[Path], None] | str, tuple[str, ...], str]] = {
    "rank_too_large": ("a64", ("rank 64 exceeds --max-lora-rank 16",), "invalid"),
    "target_outside_pool": (
        "a8",
        ("target module 'gate_proj' is not in the LoRA pool (q_proj, k_proj, v_proj, o_proj)",),
        "invalid",
    ),
    "unknown_target": (
        edit_config(target_modules=["q_proj", "score"]),
        ("unknown target module 'score'",),
        "invalid",
    ),
    "target_regex": (edit_config(target_modules=".*proj"), ("'.*proj' is a pattern",), "invalid"),
    "dora_without_magnitudes": (edit_config(use_dora=True), ("missing lora_magnitude_vector",), "invalid"),
    "modules_to_save": (edit_config(modules_to_save=["lm_head"]), ("modules_to_save", "lm_head"), "invalid"),
    "bias": (edit_config(bias="all"), ("bias 'all' is not supported",), "invalid"),
    "not_lora": (edit_config(peft_type="PREFIX_TUNING"), ("peft_type 'PREFIX_TUNING'",), "invalid"),
    "missing_field": (drop_field("r"), ("lacks the field 'r'",), "invalid"),
    "malformed_json": (write("adapter_config.json", '{"r": 4,'), ("malformed adapter_config.json",), "invalid"),
    "shape_mismatch": (
        "hidden32",
        ("shape mismatch", "layers.0.self_attn.q_proj.lora_A.weight", "(4, 32)", "expected (4, 64)"),
        "invalid",
    ),
    "layer_out_of_range": ("layers3", ("layer 2 is out of range (the base model has 2 layers)",), "invalid"),
    "missing_b": (drop_tensor("layers.1.self_attn.k_proj.lora_B.weight"), ("missing lora_B", "k_proj"), "invalid"),
    "missing_weights": (
        lambda path: (path / "adapter_model.safetensors").unlink(),
        ("no adapter weights", "adapter_model.safetensors or adapter_model.bin"),
        "invalid",
    ),
    "corrupt_weights": (write("adapter_model.safetensors", "garbage"), ("cannot read the adapter weights",), "invalid"),
    "nan_weight": (
        poison_tensor("layers.1.self_attn.v_proj.lora_B.weight", float("nan")),
        ("layers.1.self_attn.v_proj.lora_B.weight", "NaN or infinite"),
        "invalid",
    ),
    "inf_weight": (
        poison_tensor("layers.0.self_attn.q_proj.lora_A.weight", float("-inf")),
        ("layers.0.self_attn.q_proj.lora_A.weight", "NaN or infinite"),
        "invalid",
    ),
    "no_config": (
        lambda path: (path / "adapter_config.json").unlink(),
        ("not a LoRA adapter", "no adapter_config.json"),
        "invalid",
    ),
    "not_a_directory": (
        lambda path: (shutil.rmtree(path), path.write_text("x")),
        ("not a LoRA adapter", "is not a directory"),
        "invalid",
    ),
    "path_missing": (shutil.rmtree, ("does not exist",), "not_found"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_invalid_adapter_is_refused(
    case: str,
    runner: ModelRunner,
    adapter_dirs: dict[str, Path],
    other_models: dict[str, Path],
    tmp_path: Path,
) -> None:
    make, fragments, kind = CASES[case]
    prompt = random_prompts([10], runner.vocab_size, seed=1)[0]
    before = a4_logits(runner, prompt)
    if isinstance(make, str):
        path = {**adapter_dirs, **other_models}[make]
    else:
        path = tmp_path / "adapter"
        shutil.copytree(adapter_dirs["a4"], path)
        make(path)
    lora_id = next(NEXT_ID)
    [result] = runner.lora.load([AdapterToLoad(lora_name=case, lora_path=str(path), lora_id=lora_id)])
    assert not result.success
    assert (result.lora_id, result.error_kind) == (lora_id, kind)
    for fragment in fragments:
        assert fragment in result.error_message, (fragment, result.error_message)
    assert lora_id not in runner.lora.adapters
    assert torch.equal(a4_logits(runner, prompt), before)  # still serving, unchanged


def test_bin_weights_load_like_safetensors(runner: ModelRunner, adapter_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "a4_bin"
    shutil.copytree(adapter_dirs["a4"], path)
    torch.save(load_file(path / "adapter_model.safetensors"), path / "adapter_model.bin")
    (path / "adapter_model.safetensors").unlink()
    [result] = runner.lora.load([AdapterToLoad(lora_name="a4bin", lora_path=str(path), lora_id=2)])
    assert result.success, result.error_message
    assert (result.lora_rank, result.target_modules) == (4, list(ATTN_MODULES))
    prompt = random_prompts([10], runner.vocab_size, seed=2)[0]
    req = ForwardReq(input_ids=prompt, num_cached_tokens=0, page_ids=[0, 1, 2], sampling=GREEDY, slot=0)
    from_bin = forward_logits(runner, ForwardBatch(batch_id=0, reqs=[req], slot_loads=[SlotLoad(slot=0, lora_id=2)]))
    assert torch.equal(from_bin, a4_logits(runner, prompt))
    runner.lora.drop([2])


def test_one_bad_adapter_does_not_fail_the_others(runner: ModelRunner, adapter_dirs: dict[str, Path]) -> None:
    specs = [
        AdapterToLoad(lora_name="bad", lora_path=str(adapter_dirs["a8"]), lora_id=3),
        AdapterToLoad(lora_name="good", lora_path=str(adapter_dirs["a4"]), lora_id=4),
        AdapterToLoad(lora_name="dup", lora_path=str(adapter_dirs["a4"]), lora_id=4),
    ]
    results = runner.lora.load(specs)
    assert [(r.lora_id, r.success) for r in results] == [(3, False), (4, True), (4, False)]
    assert "already loaded" in results[2].error_message
    runner.lora.drop([4])
    assert 4 not in runner.lora.adapters


def test_weights_that_overflow_the_pool_dtype_are_refused() -> None:
    tensors = {"fine": torch.ones(2, 3), "huge": torch.full((2, 3), 1e6)}  # finite in fp32, inf in fp16
    assert _finite_in_dtype(tensors, torch.float32)["huge"].dtype == torch.float32
    with pytest.raises(AdapterLoadError, match="'huge' holds NaN or infinite values as float16"):
        _finite_in_dtype(tensors, torch.float16)


def test_finite_weights_whose_sum_overflows_are_kept() -> None:
    # The one-pass check sums the buffer; a sum that overflows on finite values must not refuse the adapter.
    tensors = {"a": torch.full((4,), 3e38), "b": torch.full((2, 2), -1.0)}
    copies = _finite_in_dtype(tensors, torch.float32)
    assert all(torch.equal(copies[k], tensors[k]) for k in tensors)


def test_tp_shards_do_not_keep_the_whole_adapter(runner: ModelRunner, adapter_dirs: dict[str, Path]) -> None:
    # The read casts every tensor into one buffer; a TP rank must keep copies of its shards, not views of that buffer.
    adapter = load_adapter(str(adapter_dirs["a4"]), 50, runner.lora.model_config, runner.lora.spec, 0, 2)
    for lora_a, lora_b in adapter.weights.values():
        for t in (lora_a, lora_b):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mapped_read_equals_the_general_read(adapter_dirs: dict[str, Path], dtype: torch.dtype) -> None:
    # One-dtype files are mapped and cast in one copy; the result must be the tensor-by-tensor read's, bit for bit.
    path = adapter_dirs["a4"] / "adapter_model.safetensors"
    mapped = _map_safetensors(str(path), dtype)
    assert mapped is not None
    general = _finite_in_dtype(load_file(path), dtype)
    assert set(mapped) == set(general)
    for key, tensor in general.items():
        assert mapped[key].dtype == dtype and torch.equal(mapped[key], tensor), key


def test_mixed_dtype_files_take_the_general_read(
    runner: ModelRunner, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    path = tmp_path / "a4_mixed"
    shutil.copytree(adapter_dirs["a4"], path)
    tensors = load_file(path / "adapter_model.safetensors")
    first = next(iter(tensors))
    tensors[first] = tensors[first].half()
    save_file(tensors, path / "adapter_model.safetensors")
    assert _map_safetensors(str(path / "adapter_model.safetensors"), torch.float32) is None
    [result] = runner.lora.load([AdapterToLoad(lora_name="mixed", lora_path=str(path), lora_id=5)])
    assert result.success, result.error_message
    kept = runner.lora.adapters[5].weights
    assert all(a.dtype == b.dtype == runner.lora.spec.dtype for a, b in kept.values())
    runner.lora.drop([5])


@pytest.mark.parametrize("all_int", [False, True])
def test_integer_tensors_are_refused(
    runner: ModelRunner, adapter_dirs: dict[str, Path], tmp_path: Path, all_int: bool
) -> None:
    path = tmp_path / "a4_int"
    shutil.copytree(adapter_dirs["a4"], path)
    tensors = load_file(path / "adapter_model.safetensors")
    keys = list(tensors) if all_int else [next(iter(tensors))]
    for key in keys:
        tensors[key] = tensors[key].to(torch.int32)
    save_file(tensors, path / "adapter_model.safetensors")
    [result] = runner.lora.load([AdapterToLoad(lora_name="int", lora_path=str(path), lora_id=6)])
    assert not result.success and result.error_kind == "invalid"
    assert "has dtype torch.int32; expected floating point" in result.error_message
    assert 6 not in runner.lora.adapters


def test_truncated_weights_are_refused(runner: ModelRunner, adapter_dirs: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "a4_cut"
    shutil.copytree(adapter_dirs["a4"], path)
    data = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes(data[: len(data) - 100])
    [result] = runner.lora.load([AdapterToLoad(lora_name="cut", lora_path=str(path), lora_id=7)])
    assert not result.success and "cannot read the adapter weights" in result.error_message
