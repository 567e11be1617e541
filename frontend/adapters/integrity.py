"""AdapterIntegrity: what the frontend checks of an adapter before any rank reads it — that it was trained for the
served base model (unless --lora-allow-base-mismatch), and, under --lora-require-manifest, that every file a rank
will read is listed in the directory's loraplex-manifest.json with its SHA-256.

The manifest is `{"files": {"relative name": "sha256 hex"}}`. Files are opened through AdapterFiles, so the hashes
are taken inside --lora-path-root as the ranks' reads are; the ranks then read the same files by name."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from typing import Any

from loraplex.protocol.adapter_config import CONFIG_FILE, AdapterLoadError
from loraplex.protocol.adapter_files import AdapterFiles
from loraplex.protocol.config import ServerConfig

logger = logging.getLogger("loraplex.adapters")

MANIFEST_FILE = "loraplex-manifest.json"
_HASH_CHUNK = 1 << 20


# The words a quantized checkpoint's name adds to its base's (`Llama-3.1-8B-Instruct-AWQ-INT4`, `Qwen3-8B-FP8`,
# `...-quantized.w4a16`, `llama-3-8b-bnb-4bit`): a QLoRA adapter names one side, the served model often the other.
_QUANT_WORDS = frozenset({"awq", "gptq", "fp8", "int4", "int8", "w4a16", "w8a16", "w8a8", "w4a8", "fp8_dynamic",
                          "dynamic", "quantized", "bnb", "4bit", "8bit", "nf4", "marlin", "gemm", "compressed"})
_WORD_SEPARATOR = re.compile(r"[-_.]")


def _last_component(name: str) -> str:
    return os.path.basename(os.path.normpath(name)).lower()


def _without_quant_words(name: str) -> str:
    """The name without the quantization words at its end (`llama-3.1-8b-instruct-awq-int4` -> `llama-3.1-8b-
    instruct`); a name made of nothing else is kept whole."""
    words = _WORD_SEPARATOR.split(name)
    while len(words) > 1 and words[-1] in _QUANT_WORDS:
        words.pop()
    return name[: len("-".join(words))]  # separators are one character each


class AdapterIntegrity:
    def __init__(self, config: ServerConfig):
        self.model_name = config.model_name
        # the served model by the last component of its path (or Hub id), and by --served-model-name; each also
        # without the words a quantized checkpoint's name adds
        names = {_last_component(config.model_path), config.model_name.lower()}
        self.base_names = names | {_without_quant_words(name) for name in names}
        self.allow_base_mismatch = config.lora_allow_base_mismatch
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
        if not isinstance(base, str) or not base or self._is_served(base):
            return
        message = (f"base_model_mismatch: adapter {lora_name!r} was trained for base model {base!r}, but this server "
                   f"serves {self.model_name!r}")
        if self.allow_base_mismatch:
            logger.warning("%s; loaded anyway (--lora-allow-base-mismatch)", message)
            return
        raise AdapterLoadError(f"{message} (start with --lora-allow-base-mismatch to load it anyway)",
                               "base_model_mismatch")

    def _is_served(self, base: str) -> bool:
        last = _last_component(base)
        return any(name in self.base_names for name in (base.lower(), last, _without_quant_words(last)))

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

