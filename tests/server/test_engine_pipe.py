"""The engine's pipe read by the event loop itself (EngineClient._on_readable): every message that is
ready together is taken in one go, in order, each StepOutput reaches its request's queue as its own
item (nothing is dropped or reordered by the batching), a failed step ends only its requests, and
the pipe's EOF is seen on the loop and handled as a lost engine."""

import asyncio
import multiprocessing as mp
import os
import queue
import random
import threading
import time
from types import SimpleNamespace

import pytest

from tpfuse.config import EngineConfig
from tpfuse.engine.engine import StepOutput
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.server.engine_client import EngineClient, EngineDied


def _output(request_id: str, token: int, finished: bool = False) -> StepOutput:
    return StepOutput(request_id, [token], finished, "length" if finished else None, 1, 0)


async def _drain(q: asyncio.Queue, count: int) -> list:
    return [await asyncio.wait_for(q.get(), 10) for _ in range(count)]


def test_outputs_ready_together_reach_their_queues_in_order_and_eof_is_a_lost_engine():
    fatal: list[str] = []
    lost = threading.Event()
    on_fatal = lambda reason: (fatal.append(reason), lost.set())
    client = EngineClient(EngineConfig(model="tiny", device="cpu"), restart=False, on_fatal=on_fatal)
    parent, child = mp.Pipe()
    engine = SimpleNamespace(conn=parent, outbox=queue.SimpleQueue(), lost_reason=None)
    engine.reap = lambda timeout: 0  # its exit code
    client._engine, client.state = engine, "ready"

    async def run():
        client.attach(asyncio.get_running_loop())
        params = SamplingParams(max_tokens=3)
        qa, qb, qc = (client.submit(r, [1, 2], params) for r in "abc")
        # all of these are in the pipe before the loop reads it: one wake-up takes them all
        child.send(("outputs", [_output("a", 10), _output("b", 20)]))
        child.send(("stats", {"num_running": 2}))
        child.send(("outputs", [_output("a", 11), _output("b", 21)]))
        child.send(("step_failed", ["b"], "Traceback: a step failed on purpose"))
        child.send(("rejected", "c", "prompt too long", None))
        child.send(("outputs", [_output("a", 12, finished=True)]))
        client._start_reading(engine)
        a = await _drain(qa, 3)
        assert [o.new_token_ids for o in a] == [[10], [11], [12]] and a[-1].finished
        b = await _drain(qb, 3)
        assert [o.new_token_ids for o in b[:2]] == [[20], [21]] and isinstance(b[2], EngineDied)
        (c,) = await _drain(qc, 1)
        assert isinstance(c, ValueError) and "prompt too long" in str(c)
        assert client.stats == {"num_running": 2} and client.num_pending == 0
        qd = client.submit("d", [1], params)
        child.close()  # the engine process is gone: EOF on the loop, then _lost in a thread
        (d,) = await _drain(qd, 1)
        assert isinstance(d, EngineDied)
        assert await asyncio.to_thread(lost.wait, 10)

    asyncio.run(run())
    assert client.state == "failed" and "the engine process exited" in fatal[0]


class _LibuvLikeLoop(asyncio.SelectorEventLoop):
    """A selector loop whose add_reader makes the fd non-blocking, as uvloop's (libuv's uv_poll_init)
    does: the property that lost requests on the H200, tested also where uvloop is not installed."""

    def add_reader(self, fd, callback, *args):
        super().add_reader(fd, callback, *args)
        os.set_blocking(fd, False)


def _loop_factories():
    factories = [pytest.param(_LibuvLikeLoop, id="libuv-like")]
    try:
        import uvloop

        factories.append(pytest.param(uvloop.new_event_loop, id="uvloop"))
    except ImportError:  # uvloop is a dev dependency on Linux and macOS; elsewhere the stand-in runs
        pass
    return factories


def _slow_engine(conn, step_s: float, expected: int) -> None:
    """The engine's side of the pipe: a step of step_s, then every message that arrived meanwhile;
    each request is answered with one finished output."""
    answered = 0
    while answered < expected:
        time.sleep(step_s)
        outputs = []
        while conn.poll():
            message = conn.recv()
            if message[0] == "add":
                outputs.append(_output(message[1], 7, finished=True))
        if outputs:
            conn.send(("outputs", outputs))
            answered += len(outputs)


@pytest.mark.parametrize("new_loop", _loop_factories())
def test_a_burst_of_long_prompts_reaches_a_busy_engine_whatever_the_event_loop(new_loop):
    """256 requests of 1024 token ids (more than the socket buffer holds) sent at once while the
    engine is in a step: every one reaches it. The pipe is read by the event loop and written by the
    writer thread; before _start_reading put it back to blocking, uvloop's non-blocking fd made the
    writer's send raise BlockingIOError and the writer thread end, and the requests after it were
    never sent (the engine went idle with 191 of 256 unanswered until the watchdog killed it)."""
    client = EngineClient(EngineConfig(model="tiny", device="cpu"), restart=False, step_timeout_s=0)
    parent, child = mp.Pipe()
    engine = SimpleNamespace(conn=parent, outbox=queue.SimpleQueue(), lost_reason=None)
    client._engine, client.state = engine, "ready"
    n = 256
    threading.Thread(target=client._write, args=(engine,), daemon=True).start()
    threading.Thread(target=_slow_engine, args=(child, 0.05, n), daemon=True).start()
    rng = random.Random(0)

    async def run():
        client.attach(asyncio.get_running_loop())
        client._start_reading(engine)
        params = SamplingParams(max_tokens=1)
        prompts = [[rng.randrange(65536, 128256) for _ in range(1024)] for _ in range(n)]
        queues = [client.submit(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]
        done = await asyncio.wait_for(asyncio.gather(*(q.get() for q in queues)), 20)
        assert all(o.finished and o.new_token_ids == [7] for o in done)
        assert os.get_blocking(parent.fileno())

    loop = new_loop()
    try:
        loop.run_until_complete(run())
    finally:
        loop.close()
        engine.outbox.put(None)


def test_a_request_that_cannot_be_pickled_is_rejected_and_the_writer_goes_on():
    client = EngineClient(EngineConfig(model="tiny", device="cpu"), restart=False, step_timeout_s=0)
    parent, child = mp.Pipe()
    engine = SimpleNamespace(conn=parent, outbox=queue.SimpleQueue(), lost_reason=None)
    client._engine, client.state = engine, "ready"
    threading.Thread(target=client._write, args=(engine,), daemon=True).start()

    async def run():
        client.attach(asyncio.get_running_loop())
        bad = client.submit("bad", [1], lambda: None)  # a lambda does not pickle
        client.submit("good", [2], SamplingParams(max_tokens=1))
        rejected = await asyncio.wait_for(bad.get(), 10)
        assert isinstance(rejected, ValueError) and "could not be passed to the engine" in str(rejected)
        assert await asyncio.to_thread(child.poll, 10)
        assert child.recv()[:3] == ("add", "good", [2])

    asyncio.run(run())
    engine.outbox.put(None)


def test_a_start_up_refusal_is_one_line_and_an_unexpected_failure_keeps_its_traceback(monkeypatch):
    from tpfuse.model.loader import CheckpointError
    from tpfuse.server import engine_process

    monkeypatch.setattr(engine_process.signal, "signal", lambda *a: None)
    monkeypatch.setattr(engine_process.faulthandler, "register", lambda *a, **k: None)
    for error, traceback_expected in ((CheckpointError("tensor x is missing; re-download"), False),
                                      (RuntimeError("a bug"), True)):  # fmt: skip

        def factory(config, error=error):
            raise error

        ours, theirs = mp.Pipe()
        engine_process.run_engine_loop(theirs, EngineConfig(model="tiny", device="cpu"), factory)
        kind, message = ours.recv()
        assert kind == "failed" and message.startswith(f"{type(error).__name__}: {error}")
        assert ("Traceback" in message) == traceback_expected
