"""Adapters from storage: a load's path may name a Hugging Face Hub repo (`org/name[@revision]`, or `hf://org/name`)
or an S3 prefix (`s3://bucket/prefix`). `AdapterCache` brings its adapter files into a local directory under
--lora-cache-dir and hands back that directory, which is then checked and read like any other.

Each fetch runs in a thread (the caller's executor): it blocks on the network. An entry is keyed by what it holds: a
Hub commit (a branch or tag is resolved to its commit first, so a moved branch is downloaded anew) or an S3 listing
(keys, ETags, sizes). Files are downloaded into a temporary directory beside the entries and renamed into place only
when complete, so a half-downloaded adapter is never seen under an entry's name. The cache is capped in bytes: past
the cap, the least recently used entries go (never the one just fetched).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass

from loraplex.protocol.adapters.adapter_config import CONFIG_FILE, WEIGHT_FILES
from loraplex.protocol.errors import ServerError
from loraplex.protocol.model_ref import COMMIT as _COMMIT
from loraplex.protocol.model_ref import HUB_ID as _REPO_ID

logger = logging.getLogger("loraplex.adapters")

# the files an adapter is read from (protocol/adapters/adapter_files.py), and its manifest; nothing else is downloaded
ADAPTER_FILES = (CONFIG_FILE, *WEIGHT_FILES, "loraplex-manifest.json")


class SourceError(ServerError):
    """A remote adapter that cannot be fetched; `kind` as for any adapter error (not_found: no such repo, revision,
    bucket or prefix; unavailable: the transfer failed)."""


@dataclass(frozen=True)
class RemoteAdapter:
    scheme: str  # "hf" or "s3"
    location: str  # repo id, or bucket/prefix
    revision: str | None = None  # Hub only: branch, tag or commit (None: the default branch)

    def __str__(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.location}"
        return self.location + (f"@{self.revision}" if self.revision else "")


def parse_remote(path: str) -> RemoteAdapter | None:
    """The remote adapter a lora_path names, or None for a local path. A local path wins when one exists."""
    if path.startswith("s3://"):
        bucket, _, prefix = path[len("s3://"):].partition("/")
        if not bucket:
            raise SourceError(f"{path!r}: an S3 path is s3://bucket/prefix", "invalid")
        return RemoteAdapter("s3", f"{bucket}/{prefix.strip('/')}".rstrip("/"))
    explicit = path.startswith("hf://")
    repo = path[len("hf://"):] if explicit else path
    if not explicit and (os.path.exists(path) or not _REPO_ID.match(path)):
        return None
    if not _REPO_ID.match(repo):
        raise SourceError(f"{path!r}: a Hub adapter is org/name or org/name@revision", "invalid")
    repo, _, revision = repo.partition("@")
    return RemoteAdapter("hf", repo, revision or None)


def resolver_source(resolver_dir: str, name: str) -> str | None:
    """What --lora-resolver-dir names adapter `name` by when it is remote (`s3://bucket/prefix` → the prefix's
    subfolder `name`, `hf://org` → the repo `org/name`); None for a local directory."""
    if resolver_dir.startswith("s3://"):
        return f"{resolver_dir.rstrip('/')}/{name}"
    if resolver_dir.startswith("hf://"):
        return f"hf://{resolver_dir[len('hf://'):].strip('/')}/{name}"
    return None


def default_cache_dir() -> str:
    home = os.path.expanduser("~")
    if os.access(home, os.W_OK):
        return os.path.join(home, ".cache", "loraplex", "adapters")
    return os.path.join(tempfile.gettempdir(), "loraplex-adapters")


class AdapterCache:
    """Owns --lora-cache-dir: one directory per fetched revision, and the temporary directories of downloads."""

    def __init__(self, root: str, max_bytes: int):
        self.root = os.path.realpath(root)  # made on the first fetch: a server that fetches nothing writes nothing
        self.max_bytes = max_bytes
        self._tmp_root = os.path.join(self.root, ".tmp")
        self._lock = threading.Lock()  # one fetch at a time: two loads of one adapter download it once

    def fetch(self, source: RemoteAdapter) -> str:
        """The local directory holding `source`'s adapter files, downloaded unless cached. Blocks."""
        with self._lock:
            os.makedirs(self._tmp_root, exist_ok=True)
            fetch = _fetch_hub if source.scheme == "hf" else _fetch_s3
            path = fetch(source, self)
            self._evict(keep=path)
            return path

    # ---- used by the fetchers --------------------------------------------------------------------------

    def entry_path(self, source: RemoteAdapter, version: str) -> str:
        """Where `source` at `version` lives: readable names, and a hash so that no two sources share one."""
        digest = hashlib.sha256(f"{source.scheme}\0{source.location}\0{version}".encode()).hexdigest()[:16]
        readable = re.sub(r"[^\w.\-]+", "--", source.location).strip("-")[:80]
        return os.path.join(self.root, source.scheme, f"{readable}--{digest}")

    def hit(self, source: RemoteAdapter, path: str) -> bool:
        if not os.path.isdir(path):
            return False
        os.utime(path)  # the LRU clock
        logger.info("adapter cache hit: %s -> %s", source, path)
        return True

    def install(self, source: RemoteAdapter, path: str, download) -> str:
        """Run `download(tmp_dir)` and rename the finished directory to `path` (atomic on one filesystem); a failed
        or partial download is removed and never takes the entry's name."""
        tmp = tempfile.mkdtemp(dir=self._tmp_root)
        try:
            download(tmp)
            shutil.rmtree(os.path.join(tmp, ".cache"), ignore_errors=True)  # huggingface_hub's bookkeeping
            if not os.path.isfile(os.path.join(tmp, CONFIG_FILE)):
                raise SourceError(f"{source}: no {CONFIG_FILE} there, so it is not a LoRA adapter", "invalid")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            try:
                os.rename(tmp, path)
            except OSError:  # another server sharing the cache installed it first: theirs is as good
                if not os.path.isdir(path):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        logger.info("adapter cache: fetched %s -> %s", source, path)
        return path

    def _evict(self, keep: str) -> None:
        entries = []
        for scheme in ("hf", "s3"):
            folder = os.path.join(self.root, scheme)
            if os.path.isdir(folder):
                entries += [os.path.join(folder, name) for name in os.listdir(folder)]
        sizes = {path: _dir_bytes(path) for path in entries}
        total = sum(sizes.values())
        for path in sorted(entries, key=lambda p: os.stat(p).st_mtime):
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            # renamed away first, so no reader meets a half-deleted entry under its name
            doomed = tempfile.mkdtemp(dir=self._tmp_root)
            os.rename(path, os.path.join(doomed, "entry"))
            shutil.rmtree(doomed, ignore_errors=True)
            total -= sizes[path]
            logger.info("adapter cache: evicted %s (least recently used, over --lora-cache-max-gb)", path)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, name)) for folder, _, names in os.walk(path) for name in names)


def _fetch_hub(source: RemoteAdapter, cache: AdapterCache) -> str:
    import httpx2  # huggingface_hub's HTTP client: its transport errors
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, revision = source.location, source.revision
    try:
        if revision is not None and _COMMIT.match(revision):
            commit = revision  # a commit never moves: a cached one needs no network at all
            if cache.hit(source, cache.entry_path(source, commit)):
                return cache.entry_path(source, commit)
        else:
            commit = HfApi().model_info(repo, revision=revision).sha
        path = cache.entry_path(source, commit)
        if cache.hit(source, path):
            return path
        return cache.install(source, path, lambda tmp: snapshot_download(
            repo, revision=commit, local_dir=tmp, allow_patterns=list(ADAPTER_FILES)))
    except RevisionNotFoundError as e:
        raise SourceError(f"Hub repo {repo!r} has no revision {revision!r}", "not_found") from e
    except RepositoryNotFoundError as e:
        raise SourceError(f"Hub repo {repo!r} not found (or private: set HF_TOKEN)", "not_found") from e
    except EntryNotFoundError as e:
        raise SourceError(f"{source}: {e}", "not_found") from e
    except OfflineModeIsEnabled as e:
        raise SourceError(f"{source}: no local path of that name, and the Hub is off (HF_HUB_OFFLINE)",
                          "not_found") from e
    except (HfHubHTTPError, httpx2.HTTPError, OSError) as e:  # unreachable, a cut transfer, a full disk
        raise SourceError(f"{source}: download failed: {type(e).__name__}: {e}", "unavailable") from e


def _fetch_s3(source: RemoteAdapter, cache: AdapterCache) -> str:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _, prefix = source.location.partition("/")
    key_prefix = f"{prefix}/" if prefix else ""
    try:
        client = boto3.client("s3")  # endpoint, region and credentials from the standard AWS environment
        listed = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key_prefix):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(key_prefix):]
                if name in ADAPTER_FILES:
                    listed[name] = obj
        if CONFIG_FILE not in listed:
            raise SourceError(f"{source}: no {CONFIG_FILE} under that prefix", "not_found")
        version = "\n".join(f"{n} {o['ETag']} {o['Size']}" for n, o in sorted(listed.items()))
        path = cache.entry_path(source, version)
        if cache.hit(source, path):
            return path

        def download(tmp: str) -> None:
            for name, obj in listed.items():
                client.download_file(bucket, obj["Key"], os.path.join(tmp, name))

        return cache.install(source, path, download)
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchBucket", "NoSuchKey", "404"):
            raise SourceError(f"{source}: {code} ({bucket!r})", "not_found") from e
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise SourceError(f"{source}: access denied ({code}); check the AWS credentials", "forbidden") from e
        raise SourceError(f"{source}: S3 error {code}: {e}", "unavailable") from e
    except BotoCoreError as e:  # no credentials, no region, endpoint unreachable, a cut transfer
        raise SourceError(f"{source}: {type(e).__name__}: {e}", "unavailable") from e


def cache_for(cache_dir: str | None, max_gb: float) -> AdapterCache:
    return AdapterCache(cache_dir or default_cache_dir(), int(max_gb * 1024**3))
