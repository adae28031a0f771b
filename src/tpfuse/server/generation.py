"""One request's path through the engine as seen by the HTTP process: submit, then text pieces.

Text comes from the engine's token ids through the incremental Detokenizer, which also finds stop
strings; on a stop string the request is aborted in the engine (its KV blocks are freed) and ends
with finish_reason "stop". Closing the generator early (client gone) aborts the request too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tpfuse.engine.detokenizer import Detokenizer
from tpfuse.server.engine_client import EngineClient, EngineDied
from tpfuse.server.errors import RequestError
from tpfuse.server.metrics import ServerMetrics


@dataclass(slots=True)
class Piece:
    text: str
    finish_reason: str | None  # None until the last piece
    logprobs: list = field(default_factory=list)  # TokenLogprobs of the tokens that came with it


class Generation:
    """Drives one request: `await start()` (raises RequestError if the engine rejects it), then
    `async for piece in pieces()`. Counts tokens for `usage` and records latency metrics."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer,
        metrics: ServerMetrics,
        endpoint: str,
        request_id: str,
        prompt_token_ids: list[int],
        params,
        arrival: float,
    ):
        self.client = client
        self.metrics = metrics
        self.endpoint = endpoint
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival = arrival
        self.detokenizer = Detokenizer(tokenizer, params.stop)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self._queue: asyncio.Queue | None = None
        self._first = None
        self._last_token_time: float | None = None
        self._logprobs: list = []  # arrived since the last piece

    @property
    def num_completion_tokens(self) -> int:
        return len(self.detokenizer.token_ids)

    async def start(self) -> None:
        """Submits the request and waits for its first output, so a rejection is still a 400."""
        try:
            self._queue = self.client.submit(self.request_id, self.prompt_token_ids, self.params)
            self._first = await self._next()
        except BaseException:
            self._abort()
            raise

    async def _next(self):
        return self._check(await self._queue.get())

    def _check(self, item):
        if isinstance(item, EngineDied):
            raise item
        if isinstance(item, ValueError):
            grammar = self.params.grammar
            of_grammar = grammar is not None and getattr(item, "field", None) == "grammar"
            param = grammar.source if of_grammar else None
            raise RequestError(f"the engine refused the request: {item}", param)
        return item

    def _abort(self) -> None:
        if self.finish_reason is None:
            self.client.abort(self.request_id)
            self.metrics.requests.labels(self.endpoint, "abort").inc()
            self.finish_reason = "abort"

    def _record_tokens(self, output) -> None:
        now = time.perf_counter()
        n = len(output.new_token_ids)
        if n == 0:
            return
        if self._last_token_time is None:
            self.metrics.ttft.observe(now - self.arrival)
            for _ in range(n - 1):
                self.metrics.inter_token.observe(0.0)
        else:
            gap = (now - self._last_token_time) / n
            for _ in range(n):
                self.metrics.inter_token.observe(gap)
        self._last_token_time = now
        self.metrics.generated_tokens.inc(n)

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.metrics.requests.labels(self.endpoint, reason).inc()
        self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
        self.metrics.cached_prompt_tokens.inc(self.num_cached_tokens)
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)

    def _consume(self, output) -> tuple[str, str | None]:
        """Takes one engine output; returns (new text, finish_reason or None)."""
        self._record_tokens(output)
        self.num_cached_tokens = getattr(output, "num_cached_tokens", 0) or 0
        self._logprobs += getattr(output, "logprobs", None) or []
        text = self.detokenizer.add(output.new_token_ids)
        if self.detokenizer.stopped:
            self.client.abort(self.request_id)  # frees its KV now; later outputs are dropped
            self._finish("stop")
            return text, "stop"
        if output.finished:
            self.client.release(self.request_id)
            self._finish(output.finish_reason or "stop")
            return text + self.detokenizer.flush(), self.finish_reason
        return text, None

    async def pieces(self) -> AsyncIterator[Piece]:
        """Text pieces, one per engine output, with the text that became final (maybe ""); the last
        one carries finish_reason. Outputs that queued
        up while the consumer was busy are merged into one piece, so a slow client or a busy HTTP
        process costs fewer, larger chunks rather than a growing backlog."""
        try:
            text, reason = self._consume(self._first)
            while True:
                while reason is None and not self._queue.empty():
                    more, reason = self._consume(self._check(self._queue.get_nowait()))
                    text += more
                logprobs, self._logprobs = self._logprobs, []
                if reason is not None:
                    yield Piece(text, reason, logprobs)
                    return
                yield Piece(text, None, logprobs)  # maybe "" (text held back): the tokens still arrived
                text, reason = self._consume(await self._next())
        finally:
            self._abort()  # no-op once finished
