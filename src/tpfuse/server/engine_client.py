"""The HTTP process's handle on the engine process: requests in, outputs to per-request queues, and
the engine's life (start, death, hang, restart).

An engine process whose pipe breaks (it exited, crashed or was killed) is reaped and reported on
stderr; every request it held gets EngineDied; then it is started again (restart=True) or the
server is told to exit non-zero (on_fatal). An engine that holds requests but sends nothing for
step_timeout_s (a hung step or tensor-parallel rank) is killed and handled the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from collections.abc import Callable

from tpfuse.config import EngineConfig
from tpfuse.server.engine_process import STACKS_SIGNAL, EngineInfo, make_llm_engine, run_engine_loop

WATCHDOG_INTERVAL_S = 0.5
STACKS_WAIT_S = 1.0  # for a hung engine to write its stacks before it is killed


class EngineDied(RuntimeError):
    """The engine could not serve the request: it died, hung, is restarting or the server stops."""


class Rejected(ValueError):
    """The engine refused the request (message: why). field: "grammar" when its grammar did not
    compile, else None."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def log(message: str) -> None:
    print(f"tpfuse serve: {message}", file=sys.stderr, flush=True)


class _EngineProcess:
    """One engine process, its pipe and its writer queue."""

    def __init__(self, config: EngineConfig, engine_factory: Callable):
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=run_engine_loop, args=(child_conn, config, engine_factory), name="tpfuse-engine"
        )
        self.process.start()
        child_conn.close()  # so the engine sees EOF if this process dies
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.lost_reason: str | None = None  # set by whoever decides to end it

    def reap(self, timeout: float) -> int | None:
        """Waits up to timeout for the process to exit, then kills it; returns its exit code."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        return self.process.exitcode


class EngineClient:
    """`start()` spawns the engine; once it is ready, the event loop given to `attach(loop)` reads its
    pipe and puts each output on its request's asyncio queue; sends go through a writer thread so a
    busy engine never blocks the event loop. Each request's queue receives StepOutput objects, then
    nothing more once one is finished; a rejection arrives as a ValueError instance, a lost engine
    (or a failed step of that request) as EngineDied.

    state: "starting" | "ready" | "restarting" | "failed"; failure: why it failed (for the log).
    """

    def __init__(
        self,
        config: EngineConfig,
        engine_factory: Callable = make_llm_engine,
        restart: bool = True,
        step_timeout_s: float = 120.0,
        on_fatal: Callable[[str], None] | None = None,
    ):
        self.config = config
        self.engine_factory = engine_factory
        self.restart = restart
        self.step_timeout_s = step_timeout_s
        self.on_fatal = on_fatal
        self.info: EngineInfo | None = None
        self.state = "starting"
        self.failure: str | None = None
        self.num_engine_deaths = 0
        self.stats: dict = {}
        self.ready = threading.Event()  # the first start is over (ready or failed)
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._attached = threading.Event()
        self._engine: _EngineProcess | None = None
        self._lock = threading.Lock()
        self._last_heard = time.monotonic()
        self._stopping = False

    # ---- life ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._spawn()
        threading.Thread(target=self._watch, name="tpfuse-engine-watchdog", daemon=True).start()

    def _spawn(self) -> None:
        engine = _EngineProcess(self.config, self.engine_factory)
        self._engine = engine
        threading.Thread(target=self._read, args=(engine,), name="tpfuse-engine-reader", daemon=True).start()
        threading.Thread(target=self._write, args=(engine,), name="tpfuse-engine-writer", daemon=True).start()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop that serves the requests (and reads the engine's pipe once it is ready)."""
        self._loop = loop
        self._attached.set()

    @property
    def is_ready(self) -> bool:
        return self.state == "ready"

    def wait_ready(self, timeout: float | None = None) -> EngineInfo:
        """Blocks until the engine first started; raises EngineDied with the reason (failed, timed out)."""
        if not self.ready.wait(timeout):
            raise EngineDied(f"the engine did not start within {timeout} s")
        if self.state == "failed":
            raise EngineDied(f"the engine failed to start: {self.failure}")
        return self.info

    def shutdown(self, timeout: float = 20.0) -> None:
        """Asks the engine to stop, waits, then kills it if it has not."""
        self._stopping = True
        engine, self._engine = self._engine, None
        if engine is None:
            return
        engine.lost_reason = "shutdown"
        engine.outbox.put(("shutdown",))
        engine.reap(timeout)
        engine.outbox.put(None)

    def _lost(self, engine: _EngineProcess, reason: str) -> None:
        """The engine process is gone (or must go): reap it, fail its requests, restart or give up."""
        with self._lock:
            if engine is not self._engine or self._stopping:
                return
            self._engine = None
        engine.lost_reason = engine.lost_reason or reason
        was_ready = self.state == "ready"  # else it never came up: restarting would loop
        self.state = "restarting" if was_ready and self.restart else "failed"
        self._call_soon(self._fail_all, "the engine process died while serving this request; retry it")
        code = engine.reap(timeout=10)
        engine.outbox.put(None)
        self.num_engine_deaths += was_ready
        self.failure = f"{engine.lost_reason} (exit code {code})" if code else engine.lost_reason
        if self.state == "restarting":
            log(f"the engine process died: {self.failure}; restarting it")
            self._spawn()
            return
        if was_ready:
            log(f"the engine process died: {self.failure}; exiting (--no-restart-engine)")
        elif self.num_engine_deaths:  # a first start's failure is reported by whoever waits for it
            log(f"the restarted engine failed to start: {self.failure}; exiting")
        self.ready.set()
        self._fatal(self.failure)

    def _fatal(self, reason: str) -> None:
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _watch(self) -> None:
        """Kills an engine that holds requests but has sent nothing for step_timeout_s."""
        while not self._stopping:
            time.sleep(WATCHDOG_INTERVAL_S)
            engine = self._engine
            if engine is None or self.state != "ready" or not self._queues or self.step_timeout_s <= 0:
                continue
            silent = time.monotonic() - self._last_heard
            if silent > self.step_timeout_s:
                running, waiting = self.stats.get("num_running", "?"), self.stats.get("num_waiting", "?")
                engine.lost_reason = (
                    f"the engine sent nothing for {silent:.0f} s while it held {len(self._queues)} "
                    f"request(s) (--engine-step-timeout {self.step_timeout_s:g}; its last stats: {running} "
                    f"running, {waiting} waiting): a hung step or rank; its threads' stacks are above; killed"
                )
                log(f"the engine sent nothing for {silent:.0f} s; its threads' stacks follow")
                with contextlib.suppress(OSError):
                    os.kill(engine.process.pid, STACKS_SIGNAL)
                time.sleep(STACKS_WAIT_S)
                engine.process.kill()  # the pipe's reader then sees EOF and calls _lost

    # ---- requests -----------------------------------------------------------------------------

    def submit(self, request_id: str, prompt_token_ids: list[int], params) -> asyncio.Queue:
        """Queues a request (call on the event loop); returns the queue its outputs arrive on."""
        engine = self._engine
        if not self.is_ready or engine is None:
            raise EngineDied(self.unavailable_reason())
        if not self._queues:
            self._last_heard = time.monotonic()  # an idle engine has had nothing to say
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        engine.outbox.put(("add", request_id, prompt_token_ids, params))
        return q

    def unavailable_reason(self) -> str:
        if self.state == "restarting":
            return "the engine is restarting after a failure; retry when /health answers 200"
        if self.state == "failed":
            return "the engine has failed; the server is shutting down"
        return "the engine is still loading; retry when /health answers 200"

    def abort(self, request_id: str) -> None:
        """Drops the request's queue and tells the engine to free it (harmless if already finished)."""
        engine = self._engine
        if self._queues.pop(request_id, None) is not None and engine is not None:
            engine.outbox.put(("abort", request_id))

    def release(self, request_id: str) -> None:
        """Forgets a finished request without telling the engine."""
        self._queues.pop(request_id, None)

    def end_all(self, reason: str) -> None:
        """Ends every request in flight with EngineDied(reason) (thread-safe)."""
        self._call_soon(self._fail_all, reason)

    @property
    def num_pending(self) -> int:
        return len(self._queues)

    # ---- threads ------------------------------------------------------------------------------

    def _write(self, engine: _EngineProcess) -> None:
        """The writer thread: blocking sends, in order. A message that cannot be pickled rejects its
        request; a pipe that fails while the engine process lives loses the engine (its requests get
        EngineDied at once, not after the watchdog's step timeout); an exited engine is the reader's."""
        while (message := engine.outbox.get()) is not None:
            try:
                engine.conn.send(message)
            except (OSError, ValueError) as exc:
                process = getattr(engine, "process", None)
                if engine.lost_reason is None and process is not None and process.is_alive():
                    reason = f"the pipe to the engine failed: {type(exc).__name__}: {exc}"
                    log(reason)
                    self._lost(engine, reason)
                return
            except Exception as exc:  # noqa: BLE001 - the pickler's errors are of any type
                log(f"a {message[0]!r} message could not be sent to the engine: {type(exc).__name__}: {exc}")
                if message[0] == "add":
                    rejected = ("rejected", message[1], "the request could not be passed to the engine", None)
                    self._call_soon(self._dispatch, rejected)

    def _read(self, engine: _EngineProcess) -> None:
        """The start-up reader (a thread): the engine's messages until it is ready; from then on the
        event loop reads the pipe itself (_on_readable), so no thread stands between the engine's
        outputs and the streams."""
        while True:
            try:
                message = engine.conn.recv()
            except (EOFError, OSError):
                self._lost(engine, "the engine process exited")
                return
            self._last_heard = time.monotonic()
            self._take(engine, message, [])  # nothing for the loop comes before "ready"
            if message[0] == "ready":
                break
        self._attached.wait()
        self._call_soon(self._start_reading, engine)

    def _start_reading(self, engine: _EngineProcess) -> None:
        """add_reader on the pipe, which must stay blocking: the writer thread sends on the same
        socket (a non-blocking send raises BlockingIOError once the engine is a socket buffer behind)
        and Connection.recv must read a whole message. uvloop (libuv's uv_poll_init) sets the fd
        non-blocking; the selector loop leaves it as it is."""
        if engine is self._engine:  # else it was lost meanwhile
            fd = engine.conn.fileno()
            self._loop.add_reader(fd, self._on_readable, engine)
            os.set_blocking(fd, True)

    def _on_readable(self, engine: _EngineProcess) -> None:
        """On the event loop: every message that is ready, acted on in order (outputs queued up while
        the loop was busy are taken in one wake-up). An exited engine is handled in a thread."""
        messages: list = []
        try:
            while True:
                message = engine.conn.recv()
                self._last_heard = time.monotonic()
                self._take(engine, message, messages)
                if not engine.conn.poll():
                    break
        except (EOFError, OSError):
            self._loop.remove_reader(engine.conn.fileno())
            self._dispatch_all(messages)
            reason = "the engine process exited"
            threading.Thread(target=self._lost, args=(engine, reason), daemon=True).start()
            return
        self._dispatch_all(messages)

    def _take(self, engine: _EngineProcess, message, for_loop: list) -> None:
        """Acts on one message where it was read, or appends it to for_loop (what the event loop's
        queues get: outputs, rejections, failed steps)."""
        kind = message[0]
        if kind == "ready":
            self.info = message[1]
            self.state = "ready"
            self.stats = {}
            if self.num_engine_deaths:
                log("the engine is serving again")
            self.ready.set()
        elif kind == "failed":
            engine.lost_reason = f"start-up failed: {message[1]}"
        elif kind == "crashed":
            engine.lost_reason = f"the engine loop crashed:\n{message[1]}"
        elif kind == "stats":
            self.stats = message[1]
        elif kind == "step_failed":
            log(f"a step failed; its {len(message[1])} request(s) were aborted:\n{message[2]}")
            for_loop.append(message)
        elif kind in ("outputs", "rejected"):
            for_loop.append(message)

    def _call_soon(self, fn, *args) -> None:
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(fn, *args)

    def _fail_all(self, reason: str) -> None:
        for q in self._queues.values():
            q.put_nowait(EngineDied(reason))
        self._queues.clear()

    def _fail_some(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            q = self._queues.pop(request_id, None)
            if q is not None:
                q.put_nowait(EngineDied("the engine failed while running this request; it was aborted"))

    def _dispatch_all(self, messages: list) -> None:
        for message in messages:
            if message[0] == "step_failed":
                self._fail_some(message[1])
            else:
                self._dispatch(message)

    def _dispatch(self, message) -> None:
        if message[0] == "rejected":
            q = self._queues.pop(message[1], None)
            if q is not None:
                q.put_nowait(Rejected(message[2], message[3]))
            return
        for output in message[1]:
            q = self._queues.get(output.request_id)
            if q is not None:
                q.put_nowait(output)
                if output.finished:
                    del self._queues[output.request_id]
