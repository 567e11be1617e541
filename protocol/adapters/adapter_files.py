"""A PEFT adapter directory's files, opened inside --lora-path-root: the one reader of the directory's layout and the
one confinement, used by every side that reads an adapter from disk (each worker, and node 0's frontend, which reads
the files once for the ranks on other nodes). Plain Python, no torch: it hands out open files, and the weights'
readers take it from there.

The check is on the open file, never on its name before the open: a name checked and then opened leaves a gap in
which a rename or a symlink swap slips an outside file in. So every file is opened first, the kernel's name for the
descriptor (/proc/self/fd/N, every symlink resolved) is checked, and readers that take a path are given that
descriptor's path, which names the very file checked."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from loraplex.protocol.adapters.adapter_config import CONFIG_FILE, WEIGHT_FILES, AdapterLoadError


@dataclass(frozen=True)
class AdapterFiles:
    lora_name: str  # for the messages
    root: str | None  # --lora-path-root or --lora-resolver-dir, symlinks resolved; None = read anywhere

    @classmethod
    def under(cls, lora_name: str, path_root: str | None) -> AdapterFiles:
        return cls(lora_name, os.path.realpath(path_root) if path_root else None)

    def check_dir(self, path: str) -> None:
        """An early, friendlier refusal of a directory outside the root (it also keeps the existence checks below
        from probing outside). Not the guarantee: `open` checks every file where it really is."""
        if self.root is not None and not _is_inside(os.path.realpath(path), self.root):
            raise AdapterLoadError(
                f"adapter {self.lora_name!r}: path {path!r} is outside the allowed root {self.root} "
                f"(--lora-path-root or --lora-resolver-dir)", "forbidden"
            )

    @contextlib.contextmanager
    def open(self, path: str) -> Iterator[tuple[BinaryIO, str]]:
        """`path` opened for reading, and a path that names this very open file, for readers that take a path
        (safetensors). With a root, the open file must lie inside it (see the module's comment)."""
        with open(path, "rb") as file:
            if self.root is None:
                yield file, path
                return
            fd_path = f"/proc/self/fd/{file.fileno()}"
            try:
                real_path = os.readlink(fd_path)
            except OSError as e:  # no /proc: refuse rather than read unchecked
                raise AdapterLoadError(
                    f"adapter {self.lora_name!r}: cannot confirm that {path!r} lies inside the allowed root "
                    f"{self.root} ({type(e).__name__}: {e})",
                    "internal",
                ) from e
            if not _is_inside(real_path, self.root):
                raise AdapterLoadError(
                    f"adapter {self.lora_name!r}: file {path!r} resolves outside the allowed root {self.root} "
                    "(--lora-path-root or --lora-resolver-dir; symlinks resolved)",
                    "forbidden",
                )
            yield file, fd_path

    def read_config(self, path: str) -> dict:
        """The directory's adapter_config.json as a dict (parse it with protocol.adapter_config)."""
        self.check_dir(path)
        if not os.path.exists(path):
            raise AdapterLoadError(f"adapter path {path!r} does not exist", "not_found")
        if not os.path.isdir(path):
            raise AdapterLoadError(f"not a LoRA adapter: {path!r} is not a directory")
        config_path = os.path.join(path, CONFIG_FILE)
        if not os.path.isfile(config_path):
            raise AdapterLoadError(f"not a LoRA adapter: {path!r} has no {CONFIG_FILE}")
        try:
            with self.open(config_path) as (file, _):
                raw = json.load(file)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise AdapterLoadError(f"malformed {CONFIG_FILE} in {path!r}: {e}") from e
        except OSError as e:
            raise AdapterLoadError(f"cannot read {config_path!r}: {e}") from e
        if not isinstance(raw, dict):
            raise AdapterLoadError(f"malformed {CONFIG_FILE} in {path!r}: expected a JSON object")
        return raw

    def weights_path(self, path: str) -> str:
        """The directory's weight file to open: adapter_model.safetensors, else adapter_model.bin."""
        for name in WEIGHT_FILES:
            if os.path.isfile(weights_path := os.path.join(path, name)):
                return weights_path
        raise AdapterLoadError(f"no adapter weights in {path!r}: expected {' or '.join(WEIGHT_FILES)}")


def _is_inside(real_path: str, root: str) -> bool:
    return os.path.commonpath([real_path, root]) == root
