"""loraplex-manifest.json for a test adapter: the SHA-256 of every file in its directory."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from loraplex.frontend.adapters.integrity import MANIFEST_FILE


def write_manifest(adapter_dir: str | Path) -> None:
    adapter_dir = Path(adapter_dir)
    files = sorted(p for p in adapter_dir.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    (adapter_dir / MANIFEST_FILE).write_text(json.dumps({"files": digests}, indent=1))
