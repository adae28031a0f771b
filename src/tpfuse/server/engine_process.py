"""The engine loop in its own process (the HTTP side is engine_client.py).

The two talk over one multiprocessing Pipe with pickled tuples:
  to the engine:   ("add", request_id, prompt_token_ids, SamplingParams)
                   ("abort", request_id) | ("shutdown",)
  from the engine: ("ready", EngineInfo) | ("failed", message)      once, at start-up
                   ("outputs", [StepOutput, ...])                    after every step that produced any
                   ("rejected", request_id, message, field)          add_request refused it; field:
                                                                     "grammar" (it did not compile) or None
                   ("step_failed", [request_id, ...], traceback)     step raised; those requests were
                                                                     aborted, the engine serves on
                   ("stats", {name: number | list | dict})           while busy, and on going idle
                   ("crashed", traceback)                            the loop failed; the process exits
The loop blocks on the pipe while idle and otherwise steps continuously, draining messages between
steps. A request whose grammar is not compiled yet waits while a worker thread compiles it
(grammar_admission.py), so a slow compile never stalls the other requests. When the HTTP process
goes away the pipe reads EOF and the engine shuts down: no orphans.
A step that raises aborts the requests it ran (engine.abort_failed_step) and the loop goes on;
MAX_FAILED_STEPS failures in a row (a broken device, not a bad request) end the process instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tpfuse.config import EngineConfig
from tpfuse.engine.grammar_compiler import GrammarError
from tpfuse.server.grammar_admission import GrammarAdmission

STATS_INTERVAL_S = 0.25
GRAMMAR_POLL_S = 0.005  # while idle with grammars compiling: how often the loop looks at them
MAX_FAILED_STEPS = 2


@dataclass(slots=True)
class EngineInfo:
    """What the HTTP process needs from the engine, sent once it is ready."""

    max_model_len: int
    tokenizer: Any  # tpfuse.model.tokenizer.Tokenizer (picklable)
    vocab_size: int | None = None  # the model's; token ids in a request must lie below it


def make_llm_engine(config: EngineConfig):
    from tpfuse.engine.engine import LLMEngine

    return LLMEngine(config)


def stats_dict(stats) -> dict:
    """engine.stats() as a plain dict, whether it is a dict, a dataclass or a NamedTuple."""
    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    if hasattr(stats, "_asdict"):
        return dict(stats._asdict())
    return dict(stats)


def _max_model_len(engine) -> int:
    for owner in (engine, getattr(engine, "config", None)):
        value = getattr(owner, "max_model_len", None)
        if isinstance(value, int):
            return value
    raise RuntimeError("the engine reports no max_model_len; set engine.max_model_len after start-up")


def _vocab_size(engine) -> int | None:
    for owner in (engine, getattr(engine, "model_config", None)):
        value = getattr(owner, "vocab_size", None)
        if isinstance(value, int):
            return value
    return None


def cpu_threads() -> int:
    """Torch threads for a CPU engine: the cores this process may use, less one for the HTTP
    process, so the two never oversubscribe the machine (torch's default takes every core, and
    its spinning threads slowed a 2-core run about 10x behind one other busy process)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def _set_cpu_threads(config: EngineConfig) -> None:
    if "OMP_NUM_THREADS" in os.environ:  # the user chose
        return
    with contextlib.suppress(Exception):
        if config.resolved_device() == "cpu":
            import torch

            torch.set_num_threads(cpu_threads())


STACKS_SIGNAL = signal.SIGUSR1  # on it the engine process writes every thread's stack to stderr


def run_engine_loop(conn, config: EngineConfig, engine_factory: Callable = make_llm_engine) -> None:
    """Process target: builds the engine, reports ready, then serves the pipe until shutdown or EOF.
    Ctrl-C and SIGTERM reach the whole process group; only the HTTP process acts on them (it sends
    "shutdown", or kills this process)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # the watchdog asks before it kills a hung engine
    _set_cpu_threads(config)
    try:
        engine = engine_factory(config)
        info = EngineInfo(_max_model_len(engine), engine.tokenizer, _vocab_size(engine))
        conn.send(("ready", info))
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"  # a ValueError names a bad input and its fix: no traceback
        conn.send(("failed", why if isinstance(exc, ValueError) else f"{why}\n{traceback.format_exc()}"))
        return
    try:
        _serve(conn, engine)
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # the HTTP process is gone or we are interrupted: shut down below
    except Exception:
        with contextlib.suppress(OSError):
            conn.send(("crashed", traceback.format_exc()))
    finally:
        engine.shutdown()


def _handle(engine, conn, message, grammars: GrammarAdmission | None) -> bool:
    """Applies one message; False on shutdown. A request whose grammar is still to compile waits
    in grammars (the loop goes on stepping the others)."""
    kind = message[0]
    if kind == "add":
        if grammars is not None and grammars.holds(message[3]):
            grammars.hold(message)
        else:
            _add(engine, conn, message)
    elif kind == "abort":
        if grammars is not None:
            grammars.abort(message[1])
        engine.abort_request(message[1])
    elif kind == "shutdown":
        return False
    return True


def _add(engine, conn, message) -> None:
    """engine.add_request; a request it refuses (ValueError, or any other error it raises) is
    rejected, and the engine goes on."""
    _, request_id, prompt_token_ids, params = message
    try:
        engine.add_request(request_id, prompt_token_ids, params)
    except ValueError as exc:
        _reject(conn, request_id, exc)
    except Exception:
        engine.abort_request(request_id)
        conn.send(("rejected", request_id, "the engine could not queue the request", None))
        traceback.print_exc()


def _reject(conn, request_id: str, exc: ValueError) -> None:
    conn.send(("rejected", request_id, str(exc), "grammar" if isinstance(exc, GrammarError) else None))


def _admit_compiled(engine, conn, grammars: GrammarAdmission | None) -> None:
    """Adds the requests whose grammar compiled; rejects those whose compile failed or timed out."""
    if grammars:
        for message, error in grammars.ready():
            if error is None:
                _add(engine, conn, message)
            else:
                _reject(conn, message[1], error)


def _grammar_admission(engine) -> GrammarAdmission | None:
    compiler = getattr(getattr(engine, "logits_processing", None), "grammars", None)
    return GrammarAdmission(compiler) if compiler is not None else None


class _LoopTimes:
    """Where the engine process's time goes: inside engine.step() and outside it (draining the pipe,
    sending outputs and stats), as cumulative stats entries loop_steps_total,
    loop_step_seconds_total and loop_outside_step_seconds_total, so /metrics shows whether serving
    costs the engine loop anything (benchmarks/server_overhead.py diffs them around each run).
    Time blocked on the pipe while idle is not counted."""

    def __init__(self):
        self.steps = 0
        self.in_step = 0.0
        self.outside = 0.0
        self.last_end: float | None = None

    def step(self, began: float, ended: float) -> None:
        if self.last_end is not None:
            self.outside += began - self.last_end
        self.in_step += ended - began
        self.steps += 1
        self.last_end = ended

    def idle(self) -> None:
        self.last_end = None

    def stats(self) -> dict:
        return {
            "loop_steps_total": self.steps,
            "loop_step_seconds_total": self.in_step,
            "loop_outside_step_seconds_total": self.outside,
        }


def _step(engine, conn, failures: int, times: _LoopTimes) -> int:
    """One engine step; returns the number of failed steps in a row (0 after a good one)."""
    began = time.perf_counter()
    try:
        outputs = engine.step()
    except Exception:
        report = traceback.format_exc()
        if failures + 1 >= MAX_FAILED_STEPS or not hasattr(engine, "abort_failed_step"):
            raise
        conn.send(("step_failed", engine.abort_failed_step(), report))
        return failures + 1
    times.step(began, time.perf_counter())
    if outputs:
        conn.send(("outputs", outputs))
    return 0


def _serve(conn, engine) -> None:
    last_stats = 0.0
    stats_dirty = True
    failures = 0
    times = _LoopTimes()
    grammars = _grammar_admission(engine)
    while True:
        if not engine.has_unfinished():
            if stats_dirty:
                conn.send(("stats", {**stats_dict(engine.stats()), **times.stats()}))
                stats_dirty = False
            times.idle()
            # idle: wait for a message (while grammars compile, at most GRAMMAR_POLL_S at a time)
            wait = GRAMMAR_POLL_S if grammars else None
            if conn.poll(wait) and not _handle(engine, conn, conn.recv(), grammars):
                return
        while conn.poll():
            if not _handle(engine, conn, conn.recv(), grammars):
                return
        _admit_compiled(engine, conn, grammars)
        if engine.has_unfinished():
            stats_dirty = True
            failures = _step(engine, conn, failures, times)
        now = time.monotonic()
        if now - last_stats >= STATS_INTERVAL_S:
            conn.send(("stats", {**stats_dict(engine.stats()), **times.stats()}))
            last_stats = now
