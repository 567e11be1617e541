"""AdapterIntegrity: what the frontend checks of an adapter before any rank reads it — that it was trained for the
served base model (names compared by base_names.match_base: another model for certain is refused, a name it cannot
confirm loads with a warning; --lora-strict-base-match refuses both, --lora-allow-base-mismatch neither), and, under
--lora-require-manifest, that every file a rank will read is listed in the directory's loraplex-manifest.json with
its SHA-256.

The manifest is `{"files": {"relative name": "sha256 hex"}}`. Files are opened through AdapterFiles, so the hashes
are taken inside --lora-path-root as the ranks' reads are; the ranks then read the same files by name."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

from loraplex.frontend.adapters.base_names import BaseMatch, is_hub_id, match_base
from loraplex.protocol.adapters.adapter_config import CONFIG_FILE, AdapterLoadError
from loraplex.protocol.adapters.adapter_files import AdapterFiles
from loraplex.protocol.config import ServerConfig
from loraplex.protocol.model_ref import parse_model_ref

logger = logging.getLogger("loraplex.adapters")

MANIFEST_FILE = "loraplex-manifest.json"
_HASH_CHUNK = 1 << 20


class AdapterIntegrity:
    def __init__(self, config: ServerConfig):
        self.model_name = config.model_name
        self.served_names = served_model_names(config)
        hub_ids = [name for name in self.served_names if is_hub_id(name) and name != self.model_name]
        self.served_label = f"{self.model_name!r}" + (f" ({', '.join(hub_ids)})" if hub_ids else "")
        self.allow_base_mismatch = config.lora_allow_base_mismatch
        self.strict_base_match = config.lora_strict_base_match
        self.require_manifest = config.lora_require_manifest

    def check_dir(self, lora_name: str, path: str, root: str | None) -> None:
        """A directory adapter, before any rank reads it; AdapterLoadError (with its kind) says what is wrong."""
        files = AdapterFiles.under(lora_name, root)
        if self.require_manifest:  # before the config is read, so no unlisted file is even parsed
            self._check_manifest(files, lora_name, path)
        self.check_config(lora_name, files.read_config(path))

    def check_config(self, lora_name: str, raw_config: Any) -> None:
        """adapter_config.json's base model against the served one (an adapter that names none passes)."""
        base = raw_config.get("base_model_name_or_path") if isinstance(raw_config, dict) else None
        if not isinstance(base, str) or not base:
            return
        match = match_base(base, self.served_names)
        if match is BaseMatch.SAME:
            return
        if match is BaseMatch.DIFFERENT:
            message = (f"adapter {lora_name!r} was trained for base model {base!r}, but this server serves "
                       f"{self.served_label}")
        else:
            message = (f"adapter {lora_name!r} names base model {base!r}, which may not be the served "
                       f"{self.served_label}")
        if self.allow_base_mismatch:
            logger.warning("base_model_mismatch: %s; loaded anyway (--lora-allow-base-mismatch)", message)
        elif match is BaseMatch.DIFFERENT:
            raise AdapterLoadError(f"base_model_mismatch: {message} (start with --lora-allow-base-mismatch to load it "
                                   "anyway)", "base_model_mismatch")
        elif self.strict_base_match:
            raise AdapterLoadError(f"base_model_mismatch: {message} (--lora-strict-base-match; without it the adapter "
                                   "loads with a warning)", "base_model_mismatch")
        else:
            logger.warning("base_model_mismatch: %s; loaded anyway (--lora-strict-base-match refuses it)", message)

    def _check_manifest(self, files: AdapterFiles, lora_name: str, path: str) -> None:
        files.check_dir(path)
        manifest_path = os.path.join(path, MANIFEST_FILE)
        if not os.path.isfile(manifest_path):
            raise AdapterLoadError(f"manifest_missing: adapter {lora_name!r} has no {MANIFEST_FILE} in {path!r} "
                                   "(--lora-require-manifest)", "manifest_missing")
        listed = _read_manifest(files, lora_name, manifest_path)
        for file_path in (os.path.join(path, CONFIG_FILE), files.weights_path(path)):
            name = os.path.basename(file_path)
            if name not in listed:
                raise AdapterLoadError(f"manifest_missing: adapter {lora_name!r}: {MANIFEST_FILE} does not list "
                                       f"{name!r}, which would be read", "manifest_missing")
            with files.open(file_path) as (file, _):
                digest = hashlib.file_digest(file, "sha256").hexdigest()
            if digest != listed[name].lower():
                raise AdapterLoadError(f"manifest_mismatch: adapter {lora_name!r}: {name!r} has SHA-256 {digest}, "
                                       f"{MANIFEST_FILE} says {listed[name]}", "manifest_mismatch")


def served_model_names(config: ServerConfig) -> list[str]:
    """Every name the served model is known by: --served-model-name, the model path as given (a Hub id when it is
    no local directory), its Hugging Face cache repo id, and the checkpoint's own config.json `_name_or_path`."""
    path, ref = config.model_path, config.model_ref
    names = [config.served_model_name, ref.repo_id, path if ref.is_hub else os.path.abspath(path)]
    try:
        with open(os.path.join(path, "config.json")) as file:
            own = json.load(file).get("_name_or_path")
    except (OSError, ValueError, AttributeError):  # no local checkpoint, or a config without the name
        own = None
    if isinstance(own, str) and own:
        names += [own, parse_model_ref(own).repo_id]
    return list(dict.fromkeys(name for name in names if name))


def _read_manifest(files: AdapterFiles, lora_name: str, manifest_path: str) -> dict[str, str]:
    try:
        with files.open(manifest_path) as (file, _):
            manifest = json.load(file)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterLoadError(f"manifest_mismatch: adapter {lora_name!r}: malformed {MANIFEST_FILE}: {e}",
                               "manifest_mismatch") from e
    listed = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(listed, dict) or not all(isinstance(v, str) for v in listed.values()):
        raise AdapterLoadError(f"manifest_mismatch: adapter {lora_name!r}: {MANIFEST_FILE} must be "
                               '{"files": {"relative name": "sha256 hex"}}', "manifest_mismatch")
    return listed

