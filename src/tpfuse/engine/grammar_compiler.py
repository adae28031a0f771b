"""Grammars for constrained decoding compiled by xgrammar: a cache, and compiles on worker threads.

A JSON schema with a long repetition bound or a large enum can take xgrammar seconds to minutes to
compile (the time grows about with the square of a pattern's bound). xgrammar compiles in C++
without the GIL, so `submit(grammar)` runs the compile on one of WORKERS threads and returns a
Future; the engine loop admits the request once it is done (server/engine_process.py), and a
compile slower than COMPILE_TIMEOUT_S fails its request instead of stalling every other one.
A compile cannot be interrupted: its thread runs on, and its result is cached when it ends.
`compile(grammar)` is the same, blocking (the offline engine, the loop's final check).

Errors are GrammarError (a ValueError) with xgrammar's source locations and timestamps removed.
"""

from __future__ import annotations

import queue
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future

from tpfuse.engine.sampling_params import Grammar

CACHE_SIZE = 64
WORKERS = 2
COMPILE_TIMEOUT_S = 10.0

# "[02:35:33] /project/cpp/json_schema_converter.cc:5082: " and "Check failed: (x) is false: "
_LOCATION = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: |Check failed: \([^)]*\) is false: ?")


class GrammarError(ValueError):
    """A grammar that does not compile, or not within COMPILE_TIMEOUT_S."""


def clean_message(text: str) -> str:
    """xgrammar's error text without source paths, timestamps and check expressions, on one line."""
    return " ".join(_LOCATION.sub("", text).split())


class GrammarCompiler:
    """Compiled grammars by (kind, spec), CACHE_SIZE most recently used. Thread-safe.

    make_compiler: builds the xgrammar.GrammarCompiler (on first use: it reads the vocabulary)."""

    def __init__(self, make_compiler):
        self._make_compiler = make_compiler
        self._compiler = None
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._compiling: dict[tuple[str, str], Future] = {}

    def cached(self, grammar: Grammar):
        """The compiled grammar if it is in the cache (now most recently used), else None."""
        with self._lock:
            compiled = self._cache.get(_key(grammar))
            if compiled is not None:
                self._cache.move_to_end(_key(grammar))
            return compiled

    def put(self, grammar: Grammar, compiled) -> None:
        with self._lock:
            self._cache[_key(grammar)] = compiled
            self._cache.move_to_end(_key(grammar))
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)

    def compile(self, grammar: Grammar):
        """The compiled grammar (cached). Raises GrammarError naming the problem."""
        compiled = self.cached(grammar)
        if compiled is None:
            compiled = self._compile(grammar)
            self.put(grammar, compiled)
        return compiled

    def submit(self, grammar: Grammar) -> Future:
        """compile(grammar) on a worker thread; the same Future for a grammar already compiling."""
        with self._lock:
            future = self._compiling.get(_key(grammar))
            if future is None:
                future = self._compiling[_key(grammar)] = Future()
                self._queue.put((grammar, future))
                while len(self._workers) < WORKERS:  # daemons: a runaway compile never holds up an exit
                    worker = threading.Thread(target=self._work, name="grammar-compile", daemon=True)
                    worker.start()
                    self._workers.append(worker)
            return future

    def _work(self) -> None:
        while True:
            grammar, future = self._queue.get()
            try:
                compiled = self.compile(grammar)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                error = exc
            else:
                error = None
            with self._lock:
                del self._compiling[_key(grammar)]
            if error is None:
                future.set_result(compiled)
            else:
                future.set_exception(error)

    def _compile(self, grammar: Grammar):
        with self._lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
        try:
            if grammar.kind == "json_schema":
                return self._compiler.compile_json_schema(grammar.spec, any_whitespace=False)
            if grammar.kind == "ebnf":
                return self._compiler.compile_grammar(grammar.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = clean_message(str(exc))
            raise GrammarError(f"the {grammar.kind} grammar does not compile: {message}") from None
        raise GrammarError(f"unknown grammar kind {grammar.kind!r}")


def _key(grammar: Grammar) -> tuple[str, str]:
    return grammar.kind, grammar.spec
