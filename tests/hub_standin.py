"""A local stand-in for the Hugging Face Hub's HTTP API as huggingface_hub calls it (model info with file sizes, the
file tree, file HEAD/GET with ranges), for tests that point HF_ENDPOINT at it. Repos hold commits reached by branch or
tag names; a gated repo answers its files only to `Authorization: Bearer <token>` (401 without a token, 403 with a
wrong one, as the Hub). It counts file downloads, and can cut a transfer or stall it mid-file."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

COMMIT = "1" * 40  # the one commit of a repo given at construction


@dataclass
class HubRepo:
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> file name -> bytes
    token: str | None = None  # gated: the token its files need

    def commit_of(self, revision: str | None) -> str | None:
        revision = revision or "main"
        return revision if revision in self.commits else self.refs.get(revision)


class HubStandIn(ThreadingHTTPServer):
    """`repos` given here get one commit (COMMIT) on `main`; publish() adds more. Counts file downloads (GETs with a
    body) per repo in `downloads`, and each one as (repo, file, first byte asked) in `file_gets`. A repo in `cut`
    gets half of each file, then the connection closes; a file named in `stall_after` (name -> bytes) gets that many
    bytes, then nothing until the stand-in shuts down (`stalled` is set once that point is reached); one named in
    `delay_s` (name -> seconds) starts that much later."""

    daemon_threads = True

    def __init__(self, repos: dict[str, dict[str, bytes]] | None = None):
        super().__init__(("127.0.0.1", 0), _HubHandler)
        self.repos: dict[str, HubRepo] = {}
        for repo, files in (repos or {}).items():
            self.publish(repo, files, commit=COMMIT)
        self.downloads: Counter[str] = Counter()
        self.file_gets: list[tuple[str, str, int]] = []
        self.cut: set[str] = set()
        self.stall_after: dict[str, int] = {}
        self.delay_s: dict[str, float] = {}
        self.stalled = threading.Event()
        self._released = threading.Event()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def publish(self, repo: str, files: dict[str, bytes], *, revision: str = "main", commit: str | None = None,
                token: str | None = None) -> str:
        """Add a commit of `files` to `repo` under `revision` (a branch or tag); returns the commit."""
        entry = self.repos.setdefault(repo, HubRepo())
        commit = commit or hashlib.sha1(repr(sorted((n, _oid(d)) for n, d in files.items())).encode()).hexdigest()
        entry.commits[commit] = dict(files)
        entry.refs[revision] = commit
        entry.token = token if token is not None else entry.token
        return commit

    def start(self) -> HubStandIn:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def shutdown(self) -> None:
        self._released.set()  # a stalled transfer ends
        super().shutdown()
        self.server_close()


class _HubHandler(BaseHTTPRequestHandler):
    server: HubStandIn

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path = unquote(self.path.split("?")[0])
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        match = api or resolve
        repo = self.server.repos.get(match.group(1)) if match else None
        if repo is None:
            return self._error(401, "RepoNotFound")  # the Hub's answer for a missing (or private) repo
        revision = api.group(3) if api else resolve.group(2)
        commit = repo.commit_of(revision)
        if commit is None:
            return self._error(404, "RevisionNotFound")
        files = repo.commits[commit]
        if api and api.group(2) == "tree":
            return self._json([{"type": "file", "path": name, "size": len(data), "oid": _oid(data)}
                               for name, data in files.items()], commit)
        if api:
            return self._json({"id": match.group(1), "modelId": match.group(1), "sha": commit,
                               "gated": "auto" if repo.token else False,
                               "siblings": [{"rfilename": name, "size": len(data), "blobId": _oid(data)}
                                            for name, data in files.items()]}, commit)
        if repo.token is not None:
            given = self.headers.get("Authorization", "")
            if not given:
                return self._error(401, "GatedRepo")
            if given != f"Bearer {repo.token}":
                return self._error(403, "GatedRepo")
        name = resolve.group(3)
        data = files.get(name)
        if data is None:
            return self._error(404, "EntryNotFound")
        start = int(re.match(r"bytes=(\d+)-", self.headers.get("Range", "bytes=0-")).group(1))
        self.send_response(206 if start else 200)
        self.send_header("ETag", f'"{_oid(data)}"')
        self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        self.server.downloads[match.group(1)] += 1
        self.server.file_gets.append((match.group(1), name, start))
        time.sleep(self.server.delay_s.get(name, 0.0))
        if match.group(1) in self.server.cut:  # half the file (nothing on a resumed try), then the connection drops
            self.wfile.write(data[start:][: (len(data) // 2) if not start else 0])
            self.close_connection = True
            return
        stall = self.server.stall_after.get(name)
        if stall is not None and stall > start:
            self.wfile.write(data[start:stall])
            self.wfile.flush()
            self.server.stalled.set()
            while not self.server._released.wait(0.1):
                pass
            self.close_connection = True
            return
        self.wfile.write(data[start:])

    def _json(self, payload: object, commit: str) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Repo-Commit", commit)
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    def _error(self, status: int, code: str) -> None:
        data = json.dumps({"error": code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)


def _oid(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


def dir_files(path: Path) -> dict[str, bytes]:
    """A directory's files by name (top level), as publish() takes them."""
    return {p.name: p.read_bytes() for p in Path(path).iterdir() if p.is_file()}


def hub_env(hub: HubStandIn, hf_home: Path) -> dict[str, str]:
    """The environment of a server talking to the stand-in: the Hub on, its endpoint, a cache of the test's own."""
    return {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_ENDPOINT": hub.url,
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HOME": str(hf_home), "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": ""}


def wait_for(predicate, timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False
