"""Where the built-in demo lives: `--model-path demo` serves the small Llama in demo_assets/ and its adapters.

The files are package data written by scripts/demo/train.py (the builders and the text tasks it uses live in
tests/builders.py and tests/demo_tasks.py);
SHA256SUMS lists every file's hash.
"""

from __future__ import annotations

import os
from pathlib import Path

DEMO_MODEL_PATH = "demo"
DEMO_DIR = Path(__file__).resolve().with_name("demo_assets")
# One adapter per task of tests/demo_tasks.py, in the order the server loads them at start-up.
DEMO_ADAPTERS = ("reverse", "sort", "mirror")


def resolve_model_dir(model_path: str) -> str:
    return str(DEMO_DIR) if model_path == DEMO_MODEL_PATH else model_path


def demo_adapter_paths(demo_dir: str | os.PathLike[str] = DEMO_DIR) -> dict[str, Path]:
    return {name: Path(demo_dir) / "adapters" / name for name in DEMO_ADAPTERS}
