"""The README and docs name only files of this repository that exist: a moved or deleted file leaves no stale path."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")),
        *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "scripts").rglob("*.md"))]
# a path under one of our top-level folders, with a file extension (or a glob): `worker/loader.py`, `tests/unit/*.py`
PATH = re.compile(r"(?<![\w/.-])((?:frontend|scheduler|worker|kernels|protocol|scripts|tests|deploy|docs)/[\w./*-]*"
                  r"\.[a-z*]+)\b")
# another repository's file, cited as `owner/repo `path``
CITED = re.compile(r"[\w.-]+/[\w.-]+ `$")


def named_paths(doc: str) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
        for match in PATH.finditer(line):
            if not CITED.search(line[: match.start()]):
                found.append((number, match[1]))
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_doc_names_exists(doc: str) -> None:
    missing = [f"{doc}:{number}: {path}" for number, path in named_paths(doc)
               if not (glob.glob(str(ROOT / path)) if "*" in path else (ROOT / path).exists())]
    assert missing == []


def test_the_check_sees_paths() -> None:
    assert (1, "worker/loader.py") in [(1, p) for _, p in named_paths("docs/ARCHITECTURE.md")]


def test_the_readme_stays_short() -> None:
    # the README is for users: what it does, two set-up commands, today's figures; the rest lives in docs/
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
