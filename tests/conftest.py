from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.adapter_specs import ADAPTER_SPECS
from tests.device_helpers import configure_triton

# Before anything imports transformers/huggingface_hub (fixtures import the model builders lazily for this reason):
# tests must never reach a model hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Before anything imports triton: the interpreter only where no GPU is used (device_helpers.py).
configure_triton()


TIERS = ("unit", "compute", "process", "server", "integrations")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test carries its folder's tier as a marker (`pytest -m unit` runs what `pytest tests/unit` runs)."""
    for item in items:
        tier = item.path.parent.name
        if tier in TIERS:
            item.add_marker(tier)



@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.builders import build_tiny_model

    path = tmp_path_factory.mktemp("llama")
    build_tiny_model(path, arch="llama")
    return path


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.builders import build_tiny_model

    path = tmp_path_factory.mktemp("qwen2")
    build_tiny_model(path, arch="qwen2", tie_word_embeddings=False)
    return path


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.builders import build_tiny_model

    # head_dim 32 with 4 heads: q is 128 wide against a hidden size of 64; the q/k norm weights are not all ones.
    path = tmp_path_factory.mktemp("qwen3")
    build_tiny_model(path, arch="qwen3", head_dim=32, norm_std=0.2)
    return path


@pytest.fixture(scope="session")
def qwen3_adapter_dirs(tmp_path_factory: pytest.TempPathFactory, qwen3_dir: Path) -> dict[str, Path]:
    """Two adapters on qwen3_dir: every module at rank 8, attention only at rank 16 with rsLoRA."""
    from loraplex.protocol.adapters.lora_targets import ATTN_MODULES, TARGET_MODULES

    from tests.builders import build_lora_adapter

    root = tmp_path_factory.mktemp("qwen3_adapters")
    specs = {"q8": (8, 16, TARGET_MODULES, False), "q16": (16, 32, ATTN_MODULES, True)}
    for seed, (name, (r, alpha, targets, rslora)) in enumerate(specs.items(), start=31):
        build_lora_adapter(qwen3_dir, root / name, r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                           seed=seed)  # fmt: skip
    return {name: root / name for name in specs}


@pytest.fixture(scope="session")
def adapter_specs() -> dict[str, tuple[int, float, tuple[str, ...], bool]]:
    return dict(ADAPTER_SPECS)


@pytest.fixture(scope="session")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> dict[str, Path]:
    from tests.builders import build_lora_adapter

    root = tmp_path_factory.mktemp("adapters")
    paths = {}
    for seed, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTER_SPECS.items(), start=1):
        paths[name] = root / name
        build_lora_adapter(
            llama_dir, paths[name], r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, seed=seed
        )
    return paths


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    """The trained demo model that `--model-path demo` serves (shipped files: never written to)."""
    from loraplex.frontend.demo import DEMO_DIR

    return DEMO_DIR


@pytest.fixture(scope="session")
def static_lora_server(llama_dir: Path, adapter_dirs: dict[str, Path]):
    """One tp=1 server started with every test adapter, shared by the LoRA test modules."""
    from tests.server_utils import ServerProcess

    lora_paths = [f"{name}={path}" for name, path in adapter_dirs.items()]
    with ServerProcess("--model-path", str(llama_dir), "--lora-paths", *lora_paths, "--max-loras-per-batch", "8",
                       "--max-total-tokens", "8192", "--context-length", "512") as server:
        yield server


@pytest.fixture(scope="session")
def bert_embedder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """A sentence-transformers BERT embedder (mean pooling, normalised), its adapters a8, a4 (tests/bert_models.py)."""
    from tests.bert_models import build_bert_adapters, build_bert_embedder

    root = tmp_path_factory.mktemp("bert_embedder")
    build_bert_embedder(root)
    return root / "st", build_bert_adapters(root / "st", root)


@pytest.fixture(scope="session")
def bert_cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """A BERT cross-encoder (one label) and its adapters a8, a4 (tests/bert_models.py)."""
    from tests.bert_models import build_bert_adapters, build_bert_cross_encoder

    root = tmp_path_factory.mktemp("bert_cross_encoder")
    build_bert_cross_encoder(root / "model")
    return root / "model", build_bert_adapters(root / "model", root)
