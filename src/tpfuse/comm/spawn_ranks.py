"""Local ranks for the comm commands (`comm-bench` over processes, `doctor --tp-size`): one spawned
process per rank, all told a free 127.0.0.1 port, and the first result any of them reports."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_spawned_ranks(target, world_size: int, cfg, timeout_s: float) -> tuple[str, object]:
    """target(rank, world_size, port, cfg, queue) in world_size spawned processes; returns the first
    (status, payload) a rank puts on the queue (status "ok", or a failure with its traceback), after
    joining every process (one still alive 60 s later is killed). Raises queue.Empty after timeout_s."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world_size, port, cfg, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
