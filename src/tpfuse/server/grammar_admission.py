"""The engine loop's constrained requests whose grammar is still compiling.

An "add" message whose grammar is not in the compiler's cache is held here while a worker thread
compiles it (engine/grammar_compiler.py), so the loop keeps stepping every other request meanwhile.
`ready()` hands back each held message whose compile ended, with its error: None once compiled (the
grammar is then in the cache, and add_request finds it there), else the compile's GrammarError or
the timeout, after COMPILE_TIMEOUT_S from the arrival of the message.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from tpfuse.engine.grammar_compiler import COMPILE_TIMEOUT_S, GrammarCompiler, GrammarError


@dataclass(slots=True)
class _Held:
    message: tuple  # ("add", request_id, prompt_token_ids, SamplingParams)
    future: Future
    deadline: float


class GrammarAdmission:
    def __init__(
        self,
        compiler: GrammarCompiler,
        timeout_s: float | None = None,  # None: COMPILE_TIMEOUT_S
        clock: Callable[[], float] = time.monotonic,
    ):
        self.compiler = compiler
        self.timeout_s = COMPILE_TIMEOUT_S if timeout_s is None else timeout_s
        self.clock = clock
        self._held: dict[str, _Held] = {}  # by request id, in arrival order

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, params) -> bool:
        """Whether a request with these params must wait for its grammar."""
        grammar = getattr(params, "grammar", None)
        return grammar is not None and self.compiler.cached(grammar) is None

    def hold(self, message: tuple) -> None:
        request_id, params = message[1], message[3]
        future = self.compiler.submit(params.grammar)
        self._held[request_id] = _Held(message, future, self.clock() + self.timeout_s)

    def abort(self, request_id: str) -> None:
        self._held.pop(request_id, None)

    def ready(self) -> list[tuple[tuple, GrammarError | None]]:
        """The held messages whose compile ended or ran out of time, each with its error or None."""
        now, done = self.clock(), []
        for request_id, held in list(self._held.items()):
            grammar = held.message[3].grammar
            if held.future.done():
                error = held.future.exception()
                if error is None:
                    self.compiler.put(grammar, held.future.result())  # most recent: add_request's hit
                elif not isinstance(error, GrammarError):
                    error = GrammarError(f"the {grammar.kind} grammar does not compile: {error}")
            elif now >= held.deadline:
                error = GrammarError(
                    f"the {grammar.kind} grammar did not compile within {self.timeout_s:g} s; simplify "
                    "it (long repetition bounds such as {1,50000} and enums of thousands of values "
                    "compile slowly)"
                )
            else:
                continue
            del self._held[request_id]
            done.append((held.message, error))
        return done
