"""What a model path names, read from the string alone (and whether a local directory of that name exists): a local
checkpoint directory, a Hugging Face cache snapshot (`.../models--ORG--NAME/snapshots/SHA`, whose repo id and commit
its path carries), or a Hub repo id `ORG/NAME[@REVISION]`. A local directory with the name wins over the Hub.

No download happens here (frontend/model_files.py does that, in the launcher); the config uses this for the served
model name, the adapters' base-model check for the served model's identity.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

# ORG/NAME with an optional @REVISION (a branch, tag or commit); the Hub's own rules for the two names
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+(@[\w.\-/]+)?$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# huggingface_hub's cache layout: <cache>/models--ORG--NAME/snapshots/<commit>
_SNAPSHOT = re.compile(r"(?:^|/)models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})$")


@dataclass(frozen=True)
class ModelRef:
    given: str  # the model path as given
    repo_id: str | None  # ORG/NAME: a Hub id, or the repo an HF-cache snapshot directory holds; None for a plain dir
    revision: str | None  # what to fetch (None: the default branch), or a snapshot's commit
    is_local: bool  # a directory on this machine (a snapshot included): nothing to download

    @property
    def is_hub(self) -> bool:
        return not self.is_local


def parse_model_ref(path: str, revision: str | None = None) -> ModelRef:
    """`path` as --model-path / MODEL / --tokenizer gives it; `revision` from --revision (or --tokenizer-revision).
    Raises ValueError when `ORG/NAME@REV` and a different --revision are both given."""
    if os.path.isdir(path) or not HUB_ID.match(path):
        snapshot = _SNAPSHOT.search(os.path.abspath(path).replace(os.sep, "/"))
        if snapshot is None:
            return ModelRef(path, None, None, True)
        repo_id = f"{snapshot['org']}/{snapshot['name']}"
        return ModelRef(path, repo_id, snapshot["commit"], True)
    repo_id, _, at_revision = path.partition("@")
    if at_revision and revision and at_revision != revision:
        raise ValueError(f"{path!r} names revision {at_revision!r} and --revision says {revision!r}: give one")
    return ModelRef(path, repo_id, at_revision or revision, False)
