"""frontend/ is cut by role: the ways in (entrypoints/) over the GenerateService, adapters and cluster, over the
runtime pieces. Read from the source (AST), so a wrong arrow fails here before any server starts."""

from __future__ import annotations

import ast
from pathlib import Path

FRONTEND = Path(__file__).resolve().parents[2] / "frontend"
PREFIX = "loraplex.frontend"
ENTRYPOINTS = f"{PREFIX}.entrypoints"
# The edge's libraries: the web frameworks, Ray, and the command line.
EDGE_MODULES = ("aiohttp", "ray", "fastapi", "starlette", "argparse")
# aiohttp's HTTP client, not its server: an image named by an http(s):// URL is fetched with it
HTTP_CLIENTS = {(f"{PREFIX}.multimodal.sources", "aiohttp")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(FRONTEND).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PREFIX, *parts])


MODULES = {module_name(p): p for p in FRONTEND.rglob("*.py")}
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def imported(tree: ast.Module) -> set[str]:
    """Every module a file imports, at any depth (function-level and TYPE_CHECKING imports too)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return names


def frontend_imports(name: str) -> set[str]:
    return {m for m in imported(TREES[name]) if m in MODULES and m != name}


def is_entrypoint(name: str) -> bool:
    return name == ENTRYPOINTS or name.startswith(ENTRYPOINTS + ".")


def test_only_entrypoints_know_http_ray_and_argv() -> None:
    found = []
    for name, tree in TREES.items():
        if is_entrypoint(name):
            continue
        found += [(name, m) for m in imported(tree)
                  if m.split(".")[0] in EDGE_MODULES and (name, m) not in HTTP_CLIENTS]
        found += [(name, "sys.argv") for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr == "argv"
                  and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert not found, found


def test_nothing_below_imports_the_entrypoints() -> None:
    upward = [(name, m) for name in MODULES if not is_entrypoint(name)
              for m in frontend_imports(name) if is_entrypoint(m)]
    assert not upward, upward


def test_frontend_imports_have_no_cycle() -> None:
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join((*path[path.index(name):], name)))
        if name in done:
            return
        for dep in sorted(frontend_imports(name)):
            visit(dep, (*path, name))
        done.add(name)

    for name in sorted(MODULES):
        visit(name, ())


def room(name: str) -> str:
    """A sub-package is one room; a module at frontend's top level is a room of its own."""
    parts = name.split(".")
    sub = ".".join(parts[:3])
    return sub if len(parts) > 3 or (len(parts) == 3 and (FRONTEND / parts[2]).is_dir()) else name


def run_time_imports(name: str) -> set[str]:
    """frontend_imports without those under `if TYPE_CHECKING:` (annotations only: no arrow at run time)."""
    tree = ast.parse(MODULES[name].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = [ast.Pass()]
    return {m for m in imported(tree) if m in MODULES and m != name}


def test_the_rooms_stand_at_most_seven_floors_with_no_arrow_back_up() -> None:
    arrows: dict[str, set[str]] = {}
    for name in MODULES:
        arrows.setdefault(room(name), set()).update(room(m) for m in run_time_imports(name) if room(m) != room(name))
    floors: dict[str, int] = {}

    def floor(r: str, path: tuple[str, ...]) -> int:
        if r in path:  # an arrow back up: the rooms form a cycle
            raise AssertionError("rooms in a cycle: " + " -> ".join((*path[path.index(r):], r)))
        if r not in floors:
            floors[r] = 1 + max((floor(dep, (*path, r)) for dep in arrows[r]), default=0)
        return floors[r]

    assert max(floor(r, ()) for r in sorted(arrows)) <= 7, floors
    assert floors[ENTRYPOINTS] == max(floors.values())  # the ways in stand on top


def test_the_checks_see_the_tree() -> None:
    """The walk finds the packages (a moved folder would otherwise pass every check above vacuously)."""
    assert f"{ENTRYPOINTS}.http_server" in MODULES and f"{PREFIX}.generate" in MODULES
    assert "aiohttp" in {m.split(".")[0] for m in imported(TREES[f"{ENTRYPOINTS}.http_server"])}
    assert f"{PREFIX}.generate" in frontend_imports(f"{ENTRYPOINTS}.engine")
    assert f"{PREFIX}.openai.serving" in frontend_imports(f"{ENTRYPOINTS}.openai_api")  # the HTTP-free OpenAI layer
