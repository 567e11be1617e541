"""AdapterStateFile: the adapter registry on disk (--lora-state-file), so a restart serves the same adapters.

The file is JSON, `{"version": 1, "adapters": [{"lora_name", "lora_path", "pinned"}, ...]}`, rewritten atomically
(a temporary file in the same directory, flushed to disk, then renamed over the old one) after every change.
"""

from __future__ import annotations

import logging
import os
import tempfile

import msgspec
from loraplex.protocol.structs import LoRAAdapterSpec

logger = logging.getLogger("loraplex.adapter_state")

VERSION = 1


class _Entry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    pinned: bool = False


class _State(msgspec.Struct, frozen=True):
    version: int
    adapters: list[_Entry]


class AdapterStateFile:
    def __init__(self, path: str):
        self.path = os.path.abspath(path)

    def read(self) -> list[LoRAAdapterSpec]:
        """The saved adapters; a missing file is an empty registry, an unreadable one is logged and ignored."""
        try:
            with open(self.path, "rb") as f:
                state = msgspec.json.decode(f.read(), type=_State)
        except FileNotFoundError:
            return []
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            logger.error("state file %s unreadable, starting without it: %s", self.path, e)
            return []
        if state.version != VERSION:
            logger.error("state file %s has version %d, expected %d; ignored", self.path, state.version, VERSION)
            return []
        logger.info("state file %s: %d adapter(s) to restore", self.path, len(state.adapters))
        return [LoRAAdapterSpec(lora_name=e.lora_name, lora_path=e.lora_path, pinned=e.pinned) for e in state.adapters]

    def write(self, specs: list[LoRAAdapterSpec]) -> None:
        state = _State(version=VERSION, adapters=[
            _Entry(lora_name=s.lora_name, lora_path=s.lora_path, pinned=bool(s.pinned)) for s in specs
        ])
        directory = os.path.dirname(self.path)
        fd, tmp_path = tempfile.mkstemp(prefix=".lora-state-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(msgspec.json.format(msgspec.json.encode(state)))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_path, self.path)
        except BaseException:
            os.unlink(tmp_path)
            raise
