"""What the packages may import, read from the source (AST) and, for the child processes, from a real import:
protocol/ holds no command line, kernels/ imports nothing of ours, and the processes the launcher starts never load
the CLI (they are handed the ServerConfig itself)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import msgspec
from loraplex.protocol.config import ServerConfig

REPO = Path(__file__).resolve().parents[2]
CLI_MODULES = ("loraplex.frontend.entrypoints.cli", "loraplex.frontend.entrypoints.foreign_flags")
# the modules `python -m loraplex.worker` / `-m loraplex.scheduler` run, and a headless node's (--node-rank > 0)
CHILD_ENTRY_MODULES = (
    "loraplex.worker.process", "loraplex.scheduler.process", "loraplex.frontend.entrypoints.headless",
)


def imported(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports too), relative ones resolved."""
    package = ["loraplex", *path.parent.relative_to(REPO).parts]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return names


def package_imports(folder: str) -> dict[str, set[str]]:
    files = sorted((REPO / folder).rglob("*.py"))
    assert files, f"no modules under {folder}/"  # a moved folder would pass every check vacuously
    return {str(p.relative_to(REPO)): imported(p) for p in files}


def ours_but(package: str, names: set[str]) -> list[str]:
    """The loraplex modules among names that lie outside loraplex.<package>."""
    return sorted(m for m in names if m.startswith("loraplex.") and m.split(".")[1] != package)


def test_protocol_holds_no_command_line() -> None:
    """protocol/ imports no argparse and nothing of ours but itself (so never the CLI)."""
    found = {path: sorted({m for m in names if m.split(".")[0] == "argparse"} | set(ours_but("protocol", names)))
             for path, names in package_imports("protocol").items()}
    assert {path: names for path, names in found.items() if names} == {}
    assert "loraplex.protocol.model_ref" in package_imports("protocol")["protocol/config.py"]  # the walk sees


def test_kernels_import_nothing_of_ours() -> None:
    found = {path: ours_but("kernels", names) for path, names in package_imports("kernels").items()}
    assert {path: names for path, names in found.items() if names} == {}
    assert "loraplex.kernels.segment_tiles" in package_imports("kernels")["kernels/lora_shrink.py"]  # the walk sees


def test_child_processes_never_load_the_cli() -> None:
    code = (
        "import sys\n"
        f"for name in {CHILD_ENTRY_MODULES!r}:\n"
        "    __import__(name)\n"
        f"print(sorted(m for m in {CLI_MODULES!r} if m in sys.modules))\n"
        "import loraplex.frontend.entrypoints.launch\n"  # the check can fail: the launcher does load it
        f"print(sorted(m for m in {CLI_MODULES!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", str(sorted(CLI_MODULES))]


def test_every_config_field_carries_its_help() -> None:
    missing = []
    for field in msgspec.structs.fields(ServerConfig):
        info = msgspec.inspect.type_info(field.type)
        if not (isinstance(info, msgspec.inspect.Metadata) and (info.extra_json_schema or {}).get("description")):
            missing.append(field.name)
    assert missing == []
