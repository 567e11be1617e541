"""--lora-path-root on the worker: every file an adapter read opens must lie inside the root, symlinks resolved per
file and checked on the open file itself; reloads are checked again. Without a root, symlinks load as before."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from loraplex.protocol.adapters.adapter_config import WEIGHT_FILES
from loraplex.protocol.adapters.adapter_files import AdapterFiles
from loraplex.protocol.adapters.lora_targets import ATTN_MODULES
from loraplex.protocol.structs import AdapterToLoad
from loraplex.worker.lora.adapter import AdapterLoadError, load_adapter
from loraplex.worker.model_runner import ModelRunner
from safetensors.torch import load_file

from tests.worker_helpers import make_runner

SAFETENSORS, BIN = WEIGHT_FILES
CONFIG = "adapter_config.json"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory, adapter_dirs: dict[str, Path]) -> dict[str, Path]:
    """root/: adapters whose files or directory point outside it (or inside); outside/: a plain copy of a4."""
    base = tmp_path_factory.mktemp("path_root")
    root, outside = base / "root", base / "outside"
    shutil.copytree(adapter_dirs["a4"], outside)
    shutil.copytree(adapter_dirs["a4"], root / "plain")
    torch.save(load_file(outside / SAFETENSORS), outside / BIN)
    out = {"root": root, "outside": outside, "plain": root / "plain"}
    for name, copied, linked, target in (  # the adapter's other file is a plain copy
        ("weights_out", CONFIG, SAFETENSORS, outside / SAFETENSORS),
        ("config_out", SAFETENSORS, CONFIG, outside / CONFIG),
        ("bin_out", CONFIG, BIN, outside / BIN),
        ("weights_in", CONFIG, SAFETENSORS, root / "plain" / SAFETENSORS),
    ):
        out[name] = root / name
        out[name].mkdir(parents=True)
        shutil.copy(adapter_dirs["a4"] / copied, out[name] / copied)
        (out[name] / linked).symlink_to(target)
    out["dir_out"] = root / "dir_out"
    out["dir_out"].symlink_to(outside, target_is_directory=True)
    return out


@pytest.fixture(scope="module")
def runner(llama_dir: Path, dirs: dict[str, Path]) -> ModelRunner:
    return make_runner(
        llama_dir,
        enable_lora=True,
        max_lora_rank=16,
        lora_target_modules=list(ATTN_MODULES),
        max_loras_per_batch=2,
        lora_path_root=str(dirs["root"]),
    )


def read(runner: ModelRunner, path: Path, root: Path | None, name: str = "mine"):
    lora = runner.lora
    return load_adapter(
        str(path), 1, lora.model_config, lora.spec, 0, 1, lora_name=name, path_root=None if root is None else str(root)
    )


def assert_same_weights(got, expected) -> None:
    assert got.weights.keys() == expected.weights.keys()
    for key, (lora_a, lora_b) in expected.weights.items():
        assert torch.equal(got.weights[key][0], lora_a) and torch.equal(got.weights[key][1], lora_b), key


@pytest.mark.parametrize(
    "case, file", [("weights_out", SAFETENSORS), ("config_out", CONFIG), ("bin_out", BIN), ("dir_out", None)]
)
def test_a_file_outside_the_root_is_refused(runner: ModelRunner, dirs: dict[str, Path], case: str, file: str) -> None:
    with pytest.raises(AdapterLoadError) as info:
        read(runner, dirs[case], dirs["root"], name=case)
    message = str(info.value)
    assert info.value.kind == "forbidden", message
    assert f"adapter {case!r}" in message and "--lora-path-root" in message and "outside" in message, message
    if file is not None:
        assert repr(str(dirs[case] / file)) in message, message


@pytest.mark.parametrize("case", ["plain", "weights_in"])
def test_files_inside_the_root_load(runner: ModelRunner, dirs: dict[str, Path], case: str) -> None:
    expected = read(runner, dirs["outside"], None)
    assert_same_weights(read(runner, dirs[case], dirs["root"]), expected)


def test_without_a_root_symlinks_load_as_before(runner: ModelRunner, dirs: dict[str, Path]) -> None:
    expected = read(runner, dirs["outside"], None)
    for case in ("weights_out", "config_out", "bin_out", "dir_out", "weights_in"):
        assert_same_weights(read(runner, dirs[case], None), expected)


def test_the_check_is_on_the_open_file(dirs: dict[str, Path]) -> None:
    # A swap after the open changes nothing: readers that take a path are given the open file's, not the name.
    link = dirs["root"] / "swapped"
    link.symlink_to(dirs["plain"] / CONFIG)
    try:
        with AdapterFiles("s", str(dirs["root"])).open(str(link)) as (_, opened_path):
            link.unlink()
            link.symlink_to(dirs["outside"] / SAFETENSORS)
            assert Path(opened_path).read_bytes() == (dirs["plain"] / CONFIG).read_bytes()
        with pytest.raises(AdapterLoadError, match="resolves outside"):
            with AdapterFiles("s", str(dirs["root"])).open(str(link)):
                pass
    finally:
        link.unlink()


def test_manager_refuses_and_checks_every_reload(runner: ModelRunner, dirs: dict[str, Path]) -> None:
    root = str(dirs["root"])
    outside = str(dirs["weights_out"])
    [refused] = runner.lora.load([AdapterToLoad(lora_id=3, lora_name="w", lora_path=outside, root=root)])
    assert (refused.success, refused.error_kind) == (False, "forbidden")
    assert "adapter 'w'" in refused.error_message and SAFETENSORS in refused.error_message
    assert 3 not in runner.lora.adapters
    # Loaded from inside, dropped (as a host eviction does), then the file is swapped for a link outside.
    path = dirs["root"] / "later"
    shutil.copytree(dirs["plain"], path)
    [first] = runner.lora.load([AdapterToLoad(lora_id=4, lora_name="later", lora_path=str(path), root=root)])
    assert first.success, first.error_message
    runner.lora.drop([4])
    (path / SAFETENSORS).unlink()
    (path / SAFETENSORS).symlink_to(dirs["outside"] / SAFETENSORS)
    [again] = runner.lora.load([AdapterToLoad(lora_id=5, lora_name="later", lora_path=str(path), root=root)])
    assert (again.success, again.error_kind) == (False, "forbidden"), again.error_message
    assert 5 not in runner.lora.adapters
