"""Every `python -m scripts...` command the README, docs/ and the scripts' own help name exists: its module resolves
(a package runs through its __main__.py), and `python -m scripts.bench NAME` names a row of the ratio table. A
moved or renamed tool whose old command is still written somewhere fails here."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest

from scripts.bench import ratios

REPO_ROOT = Path(__file__).resolve().parents[2]
# `python -m scripts.bench.serving --url`, `python3 -m scripts.bench prefix_cache`; placeholders (NAME) are upper case
COMMAND = re.compile(r"python3? -m (scripts(?:\.[a-z_0-9]+)*)(?: ([a-z_0-9]+))?")


def documents() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")),
            *sorted((REPO_ROOT / "scripts").rglob("*.md")), *sorted((REPO_ROOT / "scripts").rglob("*.py"))]


def named_commands() -> dict[tuple[str, str | None], list[str]]:
    """(module, first plain argument) -> the files that name it."""
    commands: dict[tuple[str, str | None], list[str]] = {}
    for path in documents():
        for match in COMMAND.finditer(path.read_text()):
            commands.setdefault((match[1], match[2]), []).append(str(path.relative_to(REPO_ROOT)))
    return commands


COMMANDS = named_commands()


def test_the_docs_name_the_tools() -> None:
    modules = {module for module, _ in COMMANDS}
    assert {"scripts.bench", "scripts.bench.all", "scripts.gpu_check", "scripts.sim.simulate",
            "scripts.demo.train"} <= modules
    assert {name for module, name in COMMANDS if module == "scripts.bench"} >= {"prefix_cache", "quantized"}


@pytest.mark.parametrize("module, argument", sorted(COMMANDS, key=str), ids=lambda v: str(v))
def test_named_command_resolves(module: str, argument: str | None) -> None:
    where = ", ".join(sorted(set(COMMANDS[module, argument])))
    spec = importlib.util.find_spec(module)
    assert spec is not None, f"`python -m {module}` (in {where}) names no module"
    if spec.submodule_search_locations is not None:  # a package: `python -m` runs its __main__
        assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{module} has no __main__.py ({where})"
    if module == "scripts.bench" and argument is not None:
        assert argument in ratios.RATIO_BENCHMARKS, f"`python -m scripts.bench {argument}` (in {where}): no such row"


@pytest.mark.parametrize("name", ratios.RATIO_BENCHMARKS)
def test_ratio_rows_have_what_the_table_runs(name: str) -> None:
    module = ratios.module(name)
    for plan in (module.FULL, module.QUICK):
        assert isinstance(plan.size, str) and plan.num_adapters > 0
    assert module.TARGETS and all(len(target) == 3 and callable(target[2]) for target in module.TARGETS.values())
    parameters = inspect.signature(module.benchmark).parameters
    assert list(parameters)[:2] == ["bench", "plan"]
    assert {"dtype", "server_threads", "repeats", "seed"} <= set(parameters)
