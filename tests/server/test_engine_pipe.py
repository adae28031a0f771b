"""The engine's pipe read by the event loop itself (EngineClient._on_readable): every message that is
ready together is taken in one go, in order, each StepOutput reaches its request's queue as its own
item (nothing is dropped or reordered by the batching), a failed step ends only its requests, and
the pipe's EOF is seen on the loop and handled as a lost engine."""

import asyncio
import multiprocessing as mp
import queue
import threading
from types import SimpleNamespace

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
        child.send(("rejected", "c", "prompt too long"))
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
