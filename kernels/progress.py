"""Progress of long start-up work (checkpoint loading, kernel builds): a tqdm bar when stderr is a terminal, log lines
otherwise, so a server's log says how far it got and a person at a terminal sees it move.

`Progress` counts known steps (tensors loaded, kernels compiled); `elapsed` reports work that has no count (one
compiler run) by the seconds it has taken so far.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator

# Log lines for counted work: one each time another tenth is done, so a long load logs about ten lines.
LOG_FRACTION = 0.1
# Log lines for uncounted work: one every this many seconds while it runs.
HEARTBEAT_S = 10.0


def _bar_wanted(enabled: bool) -> bool:
    return enabled and sys.stderr.isatty()


class Progress:
    def __init__(self, logger: logging.Logger, what: str, total: int, unit: str, *, enabled: bool = True):
        self.logger, self.what, self.total, self.unit, self.enabled = logger, what, total, unit, enabled
        self.done = 0
        self.start = time.perf_counter()
        self._next_log = 0.0  # fraction done at which the next log line is due
        self._logged = -1  # `done` at the last log line
        self._bar = None
        if _bar_wanted(enabled):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=what, unit=f" {unit}", file=sys.stderr, leave=False)

    def update(self, num: int = 1) -> None:
        self.done += num
        if self._bar is not None:
            self._bar.update(num)
        elif self.enabled and self.total and self.done / self.total >= self._next_log:
            self._log()
            self._next_log = (int(self.done / self.total / LOG_FRACTION) + 1) * LOG_FRACTION

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self._logged != self.done:
            self._log()  # stopped between tenths (an error): the last line says where

    def _log(self) -> None:
        self._logged = self.done
        percent = 100 * self.done / self.total if self.total else 100.0
        self.logger.info(
            "%s: %d/%d %s (%.0f%%, %.1f s)",
            self.what, self.done, self.total, self.unit, percent, time.perf_counter() - self.start,
        )  # fmt: skip

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@contextlib.contextmanager
def elapsed(logger: logging.Logger, what: str) -> Iterator[None]:
    """Reports work of unknown length while it runs: a ticking bar on a terminal, else a line every HEARTBEAT_S."""
    stop = threading.Event()
    start = time.perf_counter()
    bar = None
    if _bar_wanted(True):
        from tqdm import tqdm

        bar = tqdm(desc=what, unit=" s", file=sys.stderr, leave=False, bar_format="{desc}: {elapsed}")

    def tick() -> None:
        period = 1.0 if bar is not None else HEARTBEAT_S
        while not stop.wait(period):
            if bar is not None:
                bar.refresh()
            else:
                logger.info("%s: still running (%.0f s)", what, time.perf_counter() - start)

    ticker = threading.Thread(target=tick, name=f"progress: {what}", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()
        if bar is not None:
            bar.close()
