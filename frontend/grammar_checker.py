"""GrammarChecker: a structured-output constraint compiles, within bounds, before its request is admitted.

The compile is xgrammar's, on the server's tokenizer (protocol/grammar.py, as the sampling worker does it), so a
source that passes here compiles there too. Sources over MAX_SOURCE_BYTES or slower than COMPILE_TIMEOUT_S are
refused (a slow compile runs on to its end on a daemon thread, holding one of MAX_CONCURRENT_COMPILES meanwhile).
Outcomes are remembered by digest, good and bad, for the next request with the same source. Where xgrammar cannot be
imported (a dependency missing) or cannot read the tokenizer, every constraint is refused with a 501 saying so.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
from collections import OrderedDict
from typing import Any

from loraplex.protocol.errors import ServerError
from loraplex.protocol.grammar import compile_constraint, make_compiler, unavailable_message, xgrammar_import_error
from loraplex.protocol.structs import OutputConstraint

MAX_SOURCE_BYTES = 64 * 1024
COMPILE_TIMEOUT_S = 5.0
MAX_CONCURRENT_COMPILES = 4
MAX_REMEMBERED = 1024  # outcomes kept, least recently used dropped first
MAX_ERROR_LEN = 300
# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: " and often "Check failed: (...) is false: ".
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: .*? is false:\s*")


class GrammarChecker:
    def __init__(self) -> None:
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._outcomes: OrderedDict[bytes, str] = OrderedDict()  # digest -> "" (compiles) or why not
        self._slots: asyncio.Semaphore | None = None  # made in the serving loop, on first use
        self._unavailable: str | None = None  # why structured output cannot be served here ("" it can); None: not known

    async def check(self, constraint: OutputConstraint, field: str, tokenizer: Any, vocab_size: int) -> None:
        """Raise a ServerError (400) naming `field` and the problem, unless the constraint compiles in bounds; (501)
        when no constraint can compile here."""
        if self._unavailable is None:
            self._unavailable = await self._availability(tokenizer, vocab_size)
        if self._unavailable:
            raise ServerError(self._unavailable, kind="unsupported")
        size = len(constraint.source.encode("utf-8"))
        if size > MAX_SOURCE_BYTES:
            raise ServerError(f"{field} is {size} bytes, over the limit of {MAX_SOURCE_BYTES}")
        key = hashlib.sha256(f"{constraint.kind}\0{constraint.source}".encode()).digest()
        if key not in self._outcomes:
            self._remember(key, await self._compile(constraint, tokenizer, vocab_size))
        self._outcomes.move_to_end(key)
        problem = self._outcomes[key]
        if problem:
            raise ServerError(f"invalid {field}: {problem}")

    def _remember(self, key: bytes, problem: str) -> None:
        self._outcomes[key] = problem
        while len(self._outcomes) > MAX_REMEMBERED:
            self._outcomes.popitem(last=False)

    async def _availability(self, tokenizer: Any, vocab_size: int) -> str:
        """ "" when constraints can compile here, else why not: xgrammar's import (its own dependencies may be missing)
        and its compiler over the tokenizer (the vocabulary read once; not a request's cost, so not timed)."""
        reason = await _on_thread(xgrammar_import_error, ())
        if reason:
            return unavailable_message(reason)
        try:
            await _on_thread(self._compiler_for, (tokenizer, vocab_size))
        except Exception as e:  # noqa: BLE001 - xgrammar cannot read this tokenizer: no constraint can compile
            why = clean_message(str(e))
            return f"structured output is unavailable on this server: xgrammar cannot read its tokenizer ({why})"
        return ""

    async def _compile(self, constraint: OutputConstraint, tokenizer: Any, vocab_size: int) -> str:
        """ "" when it compiles, else why not (after _availability: the compiler is built)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(MAX_CONCURRENT_COMPILES)
        await self._slots.acquire()  # given back when the compile ends, even one that outlived its timeout
        compiled = _on_thread(compile_constraint, (self._compiler, constraint), on_done=self._slots.release)
        try:
            await asyncio.wait_for(compiled, COMPILE_TIMEOUT_S)
        except asyncio.TimeoutError:
            return f"compiling it took over {COMPILE_TIMEOUT_S:g} s"
        except Exception as e:  # noqa: BLE001 - xgrammar's parse and conversion errors (RuntimeError, ValueError, ...)
            return clean_message(str(e))
        return ""

    def _compiler_for(self, tokenizer: Any, vocab_size: int) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = make_compiler(tokenizer, vocab_size)
            return self._compiler


def clean_message(message: str) -> str:
    """xgrammar's error without its source location, on one line, cut to MAX_ERROR_LEN."""
    text = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", message.strip()))
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_LEN else text[: MAX_ERROR_LEN - 3] + "..."


def _on_thread(fn: Any, args: tuple, on_done: Any = None) -> asyncio.Future:
    """fn(*args) on a daemon thread (a compile that outlives its timeout must not hold up the process's exit, as an
    executor's threads would); on_done() runs in the loop once it returns, whether or not anyone still waits."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if on_done is not None:
            on_done()
        if future.cancelled():  # timed out: nobody waits for it
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            outcome = (fn(*args), None)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine as it is
            outcome = (None, e)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop closed meanwhile (the server stopped): nothing waits
            pass

    threading.Thread(target=run, name="grammar-compile", daemon=True).start()
    return future
