"""The engine loop in its own process, and the client the HTTP process uses to drive it.

The two talk over one multiprocessing Pipe with pickled tuples:
  to the engine:   ("add", request_id, prompt_token_ids, SamplingParams)
                   ("abort", request_id) | ("shutdown",)
  from the engine: ("ready", EngineInfo) | ("failed", message)      once, at start-up
                   ("outputs", [StepOutput, ...])                    after every step that produced any
                   ("rejected", request_id, message)                 add_request raised ValueError
                   ("stats", {name: number | list | dict})           while busy, and on going idle
                   ("crashed", traceback)                            step raised; the process exits
The loop blocks on the pipe while idle and otherwise steps continuously, draining messages between
steps. When the HTTP process goes away the pipe reads EOF and the engine shuts down: no orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing as mp
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tpfuse.config import EngineConfig

STATS_INTERVAL_S = 0.25


@dataclass(slots=True)
class EngineInfo:
    """What the HTTP process needs from the engine, sent once it is ready."""

    max_model_len: int
    tokenizer: Any  # tpfuse.model.tokenizer.Tokenizer (picklable)
    vocab_size: int | None = None  # the model's; prompt token ids must lie below it


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


def run_engine_loop(conn, config: EngineConfig, engine_factory: Callable = make_llm_engine) -> None:
    """Process target: builds the engine, reports ready, then serves the pipe until shutdown or EOF.
    Ctrl-C reaches the whole process group; only the HTTP process acts on it (it sends "shutdown")."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = engine_factory(config)
        info = EngineInfo(_max_model_len(engine), engine.tokenizer, _vocab_size(engine))
        conn.send(("ready", info))
    except Exception as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
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


def _handle(engine, conn, message) -> bool:
    """Applies one message; False on shutdown."""
    kind = message[0]
    if kind == "add":
        _, request_id, prompt_token_ids, params = message
        try:
            engine.add_request(request_id, prompt_token_ids, params)
        except ValueError as exc:
            conn.send(("rejected", request_id, str(exc)))
    elif kind == "abort":
        engine.abort_request(message[1])
    elif kind == "shutdown":
        return False
    return True


def _serve(conn, engine) -> None:
    last_stats = 0.0
    stats_dirty = True
    while True:
        if not engine.has_unfinished():
            if stats_dirty:
                conn.send(("stats", stats_dict(engine.stats())))
                stats_dirty = False
            if not _handle(engine, conn, conn.recv()):  # idle: block until there is work
                return
        while conn.poll():
            if not _handle(engine, conn, conn.recv()):
                return
        stats_dirty = True
        if engine.has_unfinished():
            outputs = engine.step()
            if outputs:
                conn.send(("outputs", outputs))
        now = time.monotonic()
        if now - last_stats >= STATS_INTERVAL_S:
            conn.send(("stats", stats_dict(engine.stats())))
            last_stats = now


class EngineDied(RuntimeError):
    pass


class EngineClient:
    """The HTTP process's handle on the engine process.

    `start()` spawns it; a reader thread turns pipe messages into per-request asyncio queues on the
    event loop given to `attach(loop)`; sends go through a writer thread so a busy engine never
    blocks the event loop. Each request's queue receives StepOutput objects, then nothing more once
    one is finished; a rejection arrives as a ValueError instance, an engine crash as EngineDied.
    """

    def __init__(self, config: EngineConfig, engine_factory: Callable = make_llm_engine):
        self.config = config
        self.engine_factory = engine_factory
        self.info: EngineInfo | None = None
        self.failure: str | None = None  # why the engine failed to start or died
        self.stats: dict = {}
        self.ready = threading.Event()  # set when ready or failed
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._process = None
        self._conn = None

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(
            target=run_engine_loop, args=(child_conn, self.config, self.engine_factory), name="tpfuse-engine"
        )
        self._process.start()
        child_conn.close()  # so the engine sees EOF if this process dies
        threading.Thread(target=self._read, name="tpfuse-engine-reader", daemon=True).start()
        threading.Thread(target=self._write, name="tpfuse-engine-writer", daemon=True).start()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @property
    def is_ready(self) -> bool:
        return self.info is not None and self.failure is None

    def wait_ready(self, timeout: float | None = None) -> EngineInfo:
        """Blocks until the engine is up; raises EngineDied with the reason if it failed or timed out."""
        if not self.ready.wait(timeout):
            raise EngineDied(f"the engine did not start within {timeout} s")
        if self.failure is not None:
            raise EngineDied(f"the engine failed to start: {self.failure}")
        return self.info

    def submit(self, request_id: str, prompt_token_ids: list[int], params) -> asyncio.Queue:
        """Queues a request (call on the event loop); returns the queue its outputs arrive on."""
        if not self.is_ready:
            raise EngineDied(self.failure or "the engine is not ready yet")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._outbox.put(("add", request_id, prompt_token_ids, params))
        return q

    def abort(self, request_id: str) -> None:
        """Drops the request's queue and tells the engine to free it (harmless if already finished)."""
        if self._queues.pop(request_id, None) is not None:
            self._outbox.put(("abort", request_id))

    def release(self, request_id: str) -> None:
        """Forgets a finished request without telling the engine."""
        self._queues.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        return len(self._queues)

    def shutdown(self, timeout: float = 20.0) -> None:
        """Asks the engine to stop, waits, then kills it if it has not."""
        if self._process is None:
            return
        self._outbox.put(("shutdown",))
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._outbox.put(None)
        self._process = None

    # ---- threads -----------------------------------------------------------------------------

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                self._fail("the engine process exited")
                return
            kind = message[0]
            if kind == "ready":
                self.info = message[1]
                self.ready.set()
            elif kind == "failed":
                self._fail(message[1])
            elif kind == "stats":
                self.stats = message[1]
            elif kind == "crashed":
                self._fail(f"the engine crashed:\n{message[1]}")
            elif kind in ("outputs", "rejected"):
                self._call_soon(self._dispatch, message)

    def _call_soon(self, fn, *args) -> None:
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(fn, *args)

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
        self.ready.set()
        self._call_soon(self._fail_all)

    def _fail_all(self) -> None:
        for q in self._queues.values():
            q.put_nowait(EngineDied(self.failure))
        self._queues.clear()

    def _dispatch(self, message) -> None:
        if message[0] == "rejected":
            q = self._queues.pop(message[1], None)
            if q is not None:
                q.put_nowait(ValueError(message[2]))
            return
        for output in message[1]:
            q = self._queues.get(output.request_id)
            if q is not None:
                q.put_nowait(output)
                if output.finished:
                    del self._queues[output.request_id]
