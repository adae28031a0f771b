"""Closed-loop load: C workers, each sending its next request the moment the previous one ends.

A request is due when its worker becomes free (at the window origin for the first C), and its
latency is measured from then, so time lost in the client (payload building, connection pool,
event-loop contention) counts against it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence

from tpfuse.bench.client import ClientConfig, RequestRecord, StreamingClient


async def run_closed_loop(
    client: StreamingClient,
    prompts: Sequence[str | list[int]],
    concurrency: int,
    max_tokens: int,
    on_done: Callable[[RequestRecord], None] | None = None,
    first_request_id: int = 0,
) -> list[RequestRecord]:
    """Send every prompt once with at most `concurrency` in flight; records in prompt order.

    Objects alive at the start are frozen out of garbage collection for the window, so a full
    collection (long with torch loaded) does not land in a latency.
    Raises ValueError for concurrency < 1.
    """
    import asyncio

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    records: list[RequestRecord | None] = [None] * len(prompts)
    next_index = 0
    gc.freeze()
    origin = time.perf_counter()

    async def worker() -> None:
        nonlocal next_index
        due = 0.0
        while next_index < len(prompts):
            i = next_index
            next_index += 1
            record = await client.send(first_request_id + i, prompts[i], max_tokens, origin, due)
            records[i] = record
            if on_done is not None:
                on_done(record)
            due = time.perf_counter() - origin

    try:
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    finally:
        gc.unfreeze()
    return [r for r in records if r is not None]


async def connect(config: ClientConfig, probe_prompt: str | list[int], ready_timeout_s: float) -> list[str]:
    """Wait for the server, resolve the model name into `config.model`, and probe which request
    fields it accepts (updating `config.length_controls`). Returns notes for the report.

    Raises ServerUnreachable or ServerRejected with a message naming the URL and the fix.
    """
    async with StreamingClient(config) as client:
        await client.wait_until_ready(ready_timeout_s)
        config.model = client.model
        await client.probe(probe_prompt)
        return list(client.notes)
