"""The model's (and tokenizer's) local files, downloaded from the Hugging Face Hub when --model-path names a Hub id.

Runs in the launcher, before any scheduler or rank starts, so a machine downloads once whatever --tp and --dp-size
say; the ranks read local files only. Downloads go through huggingface_hub into its cache (--download-dir, default the
standard Hugging Face cache, so a model another tool downloaded is reused): its per-file locks keep two servers
starting at once on one cache from writing the same file, and a file is written under a temporary name and renamed
into place only when complete. A server killed mid-download starts again with the files it finished.

Only what serving reads is fetched: the config, the generation config, the tokenizer files and chat template, a
vision-language model's image processor config, and the safetensors weights (with their index; only the shards it
names). Before the first byte the free disk space is checked against the sizes the Hub lists. Each failure is a
ModelFilesError: one line naming the cause and the fix.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loraplex.frontend.demo import resolve_model_dir
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.model_ref import COMMIT, ModelRef

logger = logging.getLogger("loraplex.model_files")

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
# What the tokenizer and chat template are read from (transformers' AutoTokenizer), and the generation config
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                   "chat_template.json")
PREPROCESSOR = "preprocessor_config.json"  # a vision-language model's image processor (frontend/multimodal/)
OTHER_WEIGHTS = ("*.bin", "*.pth", "*.pt", "*.gguf", "*.h5", "*.msgpack", "*.ckpt")
DEFAULT_BRANCH = "main"
STALE_PARTIAL_S = 600.0  # a partial download file untouched this long was left by a killed start


class ModelFilesError(Exception):
    """The model cannot be had: the message is one line, the cause and the fix."""


@dataclass(frozen=True)
class ModelFiles:
    model_dir: str  # config.json and the weights
    tokenizer_dir: str  # the tokenizer files (the model's dir unless --tokenizer names another)
    revision: str | None  # the commit served (a Hub id, or an HF-cache snapshot); None for a plain local dir


def resolve_model_files(config: ServerConfig) -> ModelFiles:
    """The local directories to serve from, downloading what is missing. Blocks; raises ModelFilesError."""
    model_dir, revision = _local_dir(config.model_ref, config, is_model=True)
    tokenizer_dir = model_dir
    if config.tokenizer_ref is not None:
        tokenizer_dir, _ = _local_dir(config.tokenizer_ref, config, is_model=False)
    return ModelFiles(model_dir, tokenizer_dir, revision)


def _local_dir(ref: ModelRef, config: ServerConfig, *, is_model: bool) -> tuple[str, str | None]:
    if ref.is_local:
        path = resolve_model_dir(ref.given)
        if is_model and not os.path.isfile(os.path.join(path, CONFIG)):
            raise ModelFilesError(f"no model at {ref.given!r}: expected a directory with {CONFIG}, or a Hub id "
                                  "ORG/NAME[@REVISION]")
        if not os.path.isdir(path):
            raise ModelFilesError(f"no tokenizer at {ref.given!r}: expected a directory, or a Hub id ORG/NAME")
        asked = config.revision if is_model else config.tokenizer_revision
        if asked and ref.revision is None:  # a snapshot directory carries its own commit
            raise ModelFilesError(f"a revision ({asked}) names a Hub revision, but {ref.given!r} is a local "
                                  "directory: give its Hub id instead, or drop the revision")
        return path, ref.revision
    weights = is_model and config.load_format != "dummy"  # dummy weights are drawn on config.json alone
    return HubDownload(ref.repo_id, ref.revision, config.download_dir, config.hf_token, is_model=is_model,
                       weights=weights).run()


class HubDownload:
    """One repo at one revision into the Hugging Face cache; run() -> (snapshot dir, commit)."""

    def __init__(self, repo_id: str, revision: str | None, cache_dir: str | None, token: str | None, *,
                 is_model: bool = True, weights: bool = True, endpoint: str | None = None):
        from huggingface_hub import constants

        self.repo_id, self.revision, self.token = repo_id, revision, token
        self.is_model = is_model  # config.json is required (a tokenizer-only repo may lack it)
        self.weights = weights  # the safetensors too
        self.endpoint = endpoint or constants.ENDPOINT  # HF_ENDPOINT
        self.cache_dir = os.path.abspath(os.path.expanduser(cache_dir or constants.HF_HUB_CACHE))
        self.repo_dir = os.path.join(self.cache_dir, "models--" + repo_id.replace("/", "--"))
        self.named = repo_id + (f"@{revision}" if revision else "")

    def run(self) -> tuple[str, str]:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return self._from_cache()
        import httpx2  # huggingface_hub's HTTP client: its transport errors
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            RemoteEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        where = f"{self.endpoint}/{self.repo_id}"
        try:
            return self._download()
        except GatedRepoError as e:
            if self.token or os.environ.get("HF_TOKEN"):
                raise ModelFilesError(f"{self.repo_id} is gated and the token given has no access to it: accept its "
                                      f"terms at {where} with that token's account") from e
            raise ModelFilesError(f"{self.repo_id} is gated: accept its terms at {where}, then give a token with "
                                  "access (--hf-token or HF_TOKEN)") from e
        except RevisionNotFoundError as e:
            raise ModelFilesError(f"Hub repo {self.repo_id} has no revision {self.revision!r}: give a branch, tag or "
                                  "commit it has (--revision, or ORG/NAME@REVISION)") from e
        except RepositoryNotFoundError as e:
            raise ModelFilesError(f"no Hub repo {self.repo_id} (nor a local directory of that name); if it is "
                                  "private, give a token with access (--hf-token or HF_TOKEN)") from e
        except RemoteEntryNotFoundError as e:
            raise ModelFilesError(f"{self.named}: a file the Hub listed is gone ({e}); start again") from e
        except (HfHubHTTPError, httpx2.HTTPError, OSError) as e:  # unreachable, a cut transfer, a full disk
            message = " ".join(str(e).split())
            raise ModelFilesError(f"downloading {self.named} failed: {type(e).__name__}: {message}; start again "
                                  "(finished files are kept), or set HF_HUB_OFFLINE=1 to serve what is cached") from e

    # ---- online --------------------------------------------------------------------------------------------

    def _download(self) -> tuple[str, str]:
        from huggingface_hub import HfApi

        api = HfApi(endpoint=self.endpoint, token=self.token)
        info = api.model_info(self.repo_id, revision=self.revision, files_metadata=True)
        commit = info.sha
        sizes = {s.rfilename: s.size or 0 for s in info.siblings or []}
        names = self._wanted(sizes)
        if INDEX in names:  # the index names the shards: other *.safetensors (e.g. consolidated.*) are not read
            index = json.loads(Path(self._fetch_one(INDEX, commit, sizes, None)).read_text())
            shards = set(index["weight_map"].values())
            missing = sorted(shards - set(sizes))
            if missing:
                raise ModelFilesError(f"{self.repo_id}@{commit[:12]}: {INDEX} names {missing[0]}, which the repo "
                                      "does not have")
            names = [n for n in names if not n.endswith(".safetensors") or n in shards]
        snapshot = os.path.join(self.repo_dir, "snapshots", commit)
        todo = [n for n in names if not os.path.exists(os.path.join(snapshot, n))]
        if todo:
            self._sweep_stale_partials()
            self._check_space(sum(sizes[n] for n in todo))
            self._fetch_all(todo, commit, sizes)
        else:
            logger.info("model %s: all %d files in the cache at %s", self._at(commit), len(names), snapshot)
        self._write_ref(commit)
        return snapshot, commit

    def _wanted(self, sizes: dict[str, int]) -> list[str]:
        top = [n for n in sizes if "/" not in n]
        names = [n for n in top if n in TOKENIZER_FILES or n in ("generation_config.json", PREPROCESSOR)]
        if CONFIG in top:
            names.insert(0, CONFIG)
        elif self.is_model:
            raise ModelFilesError(f"{self.named} has no {CONFIG}, so it is not a transformers checkpoint")
        if not self.weights:
            return names
        weights = sorted(n for n in top if n.endswith(".safetensors"))
        if not weights:
            others = sorted(n for n in top if any(fnmatch.fnmatch(n, p) for p in OTHER_WEIGHTS))
            found = f" (it has {', '.join(others[:3])})" if others else ""
            raise ModelFilesError(f"{self.named} has no .safetensors weights{found}: loraplex reads safetensors only; "
                                  "pick a revision or repo that has them, or convert it and serve the directory")
        return names + ([INDEX] if INDEX in top else []) + weights

    def _sweep_stale_partials(self) -> None:
        """Removes the partial files a killed start left (huggingface_hub writes each download to a `*.incomplete`
        file of its own and never resumes one). A download in progress writes to its file every chunk and gives up
        after seconds without data, so a file untouched for STALE_PARTIAL_S belongs to no live download."""
        blobs = Path(self.repo_dir) / "blobs"
        stale = [p for p in blobs.glob("*.incomplete") if time.time() - p.stat().st_mtime > STALE_PARTIAL_S]
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:
            logger.info("model %s: removed %d partial file(s) a stopped download left", self.repo_id, len(stale))

    def _check_space(self, needed: int) -> None:
        path = self.cache_dir
        while not os.path.isdir(path):
            path = os.path.dirname(path)
        free = shutil.disk_usage(path).free
        if needed > free:
            raise ModelFilesError(f"{self.named} needs {_size(needed)} more and {path} has {_size(free)} free: make "
                                  "room, or give --download-dir on a larger disk")

    def _fetch_all(self, names: list[str], commit: str, sizes: dict[str, int]) -> None:
        total = sum(sizes[n] for n in names)
        logger.info("model %s: downloading %d files (%s) into %s", self._at(commit), len(names), _size(total),
                    self.cache_dir)
        bar = None
        if sys.stderr.isatty():  # one bar over all bytes on a terminal; a log line per file otherwise
            from tqdm import tqdm

            bar = tqdm(total=total, desc=f"downloading {self.repo_id}", unit="B", unit_scale=True, file=sys.stderr,
                       leave=False)
        start = time.perf_counter()
        try:
            for name in names:
                self._fetch_one(name, commit, sizes, bar)
        finally:
            if bar is not None:
                bar.close()
        seconds = time.perf_counter() - start
        logger.info("model %s: downloaded %s in %.1f s (%s/s)", self._at(commit), _size(total), seconds,
                    _size(total / max(seconds, 1e-6)))

    def _fetch_one(self, name: str, commit: str, sizes: dict[str, int], bar) -> str:
        from huggingface_hub import hf_hub_download

        start = time.perf_counter()
        path = hf_hub_download(self.repo_id, name, revision=commit, cache_dir=self.cache_dir, token=self.token,
                               endpoint=self.endpoint, tqdm_class=_forward_to(bar))
        if bar is None:
            seconds = time.perf_counter() - start
            logger.info("model %s: %s (%s, %.1f s, %s/s)", self._at(commit), name, _size(sizes.get(name, 0)),
                        seconds, _size(sizes.get(name, 0) / max(seconds, 1e-6)))
        return path

    def _write_ref(self, commit: str) -> None:
        """refs/<branch or tag> -> commit, as huggingface_hub does, so HF_HUB_OFFLINE=1 later finds it by name."""
        if self.revision is not None and COMMIT.match(self.revision):
            return
        ref = os.path.join(self.repo_dir, "refs", self.revision or DEFAULT_BRANCH)
        if os.path.isfile(ref) and open(ref).read() == commit:
            return
        os.makedirs(os.path.dirname(ref), exist_ok=True)
        tmp = f"{ref}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(commit)
        os.replace(tmp, ref)  # atomic: a second server reads the old ref or this one

    def _at(self, commit: str) -> str:
        return f"{self.repo_id}@{commit[:12]}"

    # ---- offline -------------------------------------------------------------------------------------------

    def _from_cache(self) -> tuple[str, str]:
        fix = "start once with the Hub reachable (unset HF_HUB_OFFLINE), or give a local directory"
        commit = self.revision if self.revision is not None and COMMIT.match(self.revision) else None
        if commit is None:
            ref = os.path.join(self.repo_dir, "refs", self.revision or DEFAULT_BRANCH)
            if not os.path.isfile(ref):
                raise ModelFilesError(f"HF_HUB_OFFLINE=1 and {self.named} is not in the cache at {self.cache_dir}: "
                                      f"{fix}")
            commit = open(ref).read().strip()
        snapshot = os.path.join(self.repo_dir, "snapshots", commit)
        missing = self._missing_offline(snapshot)
        if missing:
            raise ModelFilesError(f"HF_HUB_OFFLINE=1 and {missing} of {self.repo_id}@{commit[:12]} is not in the "
                                  f"cache at {self.cache_dir}: {fix}")
        logger.info("model %s: from the cache at %s (HF_HUB_OFFLINE)", self._at(commit), snapshot)
        return snapshot, commit

    def _missing_offline(self, snapshot: str) -> str | None:
        """The first file serving needs that the cached snapshot lacks (the Hub's listing is out of reach)."""
        if self.is_model and not os.path.isfile(os.path.join(snapshot, CONFIG)):
            return CONFIG
        if not self.weights:
            return None
        index = os.path.join(snapshot, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            return next((s for s in shards if not os.path.isfile(os.path.join(snapshot, s))), None)
        has_weights = any(n.endswith(".safetensors") for n in os.listdir(snapshot))
        return None if has_weights else "a .safetensors file"


def _forward_to(bar):
    """A tqdm class for huggingface_hub's per-file progress that shows nothing itself and adds to `bar`."""
    from tqdm import tqdm

    class FileProgress(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if bar is not None and n:
                bar.update(n)
            return None

    return FileProgress


def _size(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    return ""
