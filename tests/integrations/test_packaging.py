"""What `pip install loraplex` puts in site-packages: one import name, `loraplex`, holding every product package and
its data files; and the editable install maps the same names onto the repository's folders."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

REPO_ROOT = Path(__file__).resolve().parents[2]
PRODUCT_DIRS = ("frontend", "scheduler", "worker", "kernels", "protocol")


def _repo_packages() -> set[str]:
    return {"loraplex." + str(init.parent.relative_to(REPO_ROOT)).replace("/", ".")
            for top in PRODUCT_DIRS for init in (REPO_ROOT / top).rglob("__init__.py")}


def test_pyproject_lists_every_package() -> None:
    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert listed == _repo_packages()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO_ROOT)],
                   check=True, capture_output=True, timeout=300)
    (path,) = out.glob("loraplex-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_installs_one_import_name(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/")[0] for name in wheel.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"loraplex"}
    modules = {name.removesuffix("/__init__.py").replace("/", ".") for name in wheel.namelist()
               if name.endswith("/__init__.py")}
    assert modules == _repo_packages()
    # loraplex is a namespace package: no loraplex/__init__.py to collide with
    assert "loraplex/__init__.py" not in wheel.namelist()


def test_wheel_carries_data_files(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for needed in ("loraplex/kernels/csrc/cpu_kernels.cpp", "loraplex/frontend/console/index.html",
                   "loraplex/frontend/demo_assets/model.safetensors", "loraplex/frontend/demo_assets/tokenizer.json",
                   "loraplex/frontend/demo_assets/adapters/sort/adapter_config.json"):
        assert needed in names, needed
    entry_points = wheel.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "loraplex = loraplex.frontend.entrypoints.launch:main" in entry_points


def test_installed_names_resolve_to_the_repository() -> None:
    """The editable install (the README's) maps `loraplex.<package>` onto the top-level folders."""
    code = "import loraplex.frontend, loraplex.worker.model, loraplex.kernels; " \
           "print(loraplex.frontend.__file__); print(loraplex.worker.model.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, check=True).stdout
    frontend_init, model_init = out.split()
    assert Path(frontend_init) == REPO_ROOT / "frontend" / "__init__.py"
    assert Path(model_init) == REPO_ROOT / "worker" / "model" / "__init__.py"


def test_product_imports_no_test_or_tool_code() -> None:
    """scripts/ and tests/ are not in the wheel: a product module that imports them breaks the installed server."""
    offenders = []
    for top in PRODUCT_DIRS:
        for path in (REPO_ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                offenders += [f"{path.relative_to(REPO_ROOT)}: {name}" for name in names
                              if name.split(".")[0] in ("scripts", "tests")]
    assert offenders == []
