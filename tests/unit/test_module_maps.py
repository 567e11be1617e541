"""Each package's __init__.py docstring carries its module map, one line per module or sub-package (STYLE.md rule
1): every module is named in the map of its package, or of its nearest parent package that has one, by its path
from there; a sub-package by `name/` (or a module inside it) in its parent's. A map that lost a module, or names
one that is gone, fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("frontend", "scheduler", "worker", "kernels", "protocol")
NAME = re.compile(r"[\w.]+(/[\w.]+)*(\.py|/)")


def map_entry(line: str) -> list[str]:
    """The paths a map line starts with (`name.py`, `a.py / b.py`, `x.py, y.py`, `sub/`), before the two or more
    spaces that lead to its description; none for prose."""
    head = re.split(r"\s{2,}", line.strip())[0]
    names = re.split(r",\s*|\s+/\s+", head)
    return names if all(NAME.fullmatch(name) for name in names) else []


def names_in_map(package: Path) -> set[str] | None:
    """The paths a package's map names (relative to the package), or None if its docstring carries no map."""
    init = package / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text())) if init.exists() else None
    names = {name for line in (doc or "").splitlines() for name in map_entry(line)}
    return names if any(name.endswith(".py") for name in names) else None


def nearest_map(package: Path, top: Path) -> tuple[Path, set[str]] | None:
    while True:
        names = names_in_map(package)
        if names is not None:
            return package, names
        if package == top:
            return None
        package = package.parent


def packages_of(top: Path) -> list[Path]:
    return sorted(p.parent for p in top.rglob("__init__.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("name", PACKAGES)
def test_every_module_is_named_in_its_map(name: str) -> None:
    top = ROOT / name
    assert names_in_map(top) is not None, f"{name}/__init__.py has no module map"
    missing = []
    for package in packages_of(top):
        mapped = nearest_map(package, top)
        for module in sorted(package.glob("*.py")):
            if module.name == "__init__.py":
                continue
            where, names = mapped
            if module.relative_to(where).as_posix() not in names:
                missing.append(f"{module.relative_to(ROOT)} (map: {where.relative_to(ROOT)}/__init__.py)")
        if package != top:  # a sub-package is named in its parent's map
            where, names = nearest_map(package.parent, top)
            prefix = package.relative_to(where).as_posix() + "/"
            if not any(name.startswith(prefix) for name in names):
                missing.append(f"{package.relative_to(ROOT)}/ (map: {where.relative_to(ROOT)}/__init__.py)")
    assert not missing, "not in the module map: " + ", ".join(missing)


@pytest.mark.parametrize("name", PACKAGES)
def test_every_name_in_a_map_exists(name: str) -> None:
    stale = []
    for package in packages_of(ROOT / name):
        for named in names_in_map(package) or ():
            if not (package / named).exists():
                stale.append(f"{named} in {package.relative_to(ROOT)}/__init__.py")
    assert not stale, "named in a module map but not there: " + ", ".join(stale)
