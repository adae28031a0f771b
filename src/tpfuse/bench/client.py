"""Async streaming client for OpenAI-compatible servers: one `RequestRecord` per request.

Times are seconds on `time.perf_counter()` minus an origin the caller picks (the start of a measured
window), so records of one window share a clock. A failed request is recorded with its error, never
raised; only an unreachable server raises (`ServerUnreachable`).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import asdict, dataclass, field

import httpx

ENDPOINTS = ("completions", "chat")
# Fields beyond the OpenAI schema that pin the output length and report tokens per chunk.
LENGTH_CONTROL_FIELDS = ("ignore_eos", "min_tokens", "stream_options.continuous_usage_stats")


class ServerUnreachable(RuntimeError):
    """No server answered at the URL within the timeout."""


class ServerRejected(RuntimeError):
    """The server answered but refused the benchmark's request (bad model, endpoint or payload)."""


@dataclass(slots=True)
class ClientConfig:
    """How to talk to the server. `url` is the base (with or without a trailing /v1)."""

    url: str
    model: str | None = None  # None: the first id from /v1/models
    endpoint: str = "completions"  # completions | chat
    api_key: str | None = None
    temperature: float = 0.0
    length_controls: bool = True  # send ignore_eos / min_tokens / continuous usage stats
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    extra_body: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.url!r}")
        if self.request_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("--request-timeout and --connect-timeout must be > 0 seconds")
        self.url = self.url.rstrip("/").removesuffix("/v1")

    def endpoint_url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.url + path


@dataclass(slots=True)
class RequestRecord:
    """One request. Times in seconds from the window origin; `scheduled_s` is when it was due.

    chunk_times_s / chunk_tokens: arrival time and token count of each chunk carrying tokens (counts
    may be fractional when estimated, see `chunk_tokens_source`). completion_tokens comes from the
    server's usage; client_completion_tokens from re-tokenizing the text (None without a tokenizer).
    """

    request_id: int
    max_tokens: int
    scheduled_s: float
    start_s: float = 0.0
    first_token_s: float | None = None
    end_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[float] = field(default_factory=list)
    chunk_tokens_source: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    client_completion_tokens: int | None = None
    client_prompt_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> float:
        """Server usage when reported, else the client's count, else the sum of chunk tokens."""
        if self.completion_tokens is not None:
            return self.completion_tokens
        if self.client_completion_tokens is not None:
            return self.client_completion_tokens
        return sum(self.chunk_tokens)

    def to_dict(self, keep_text: bool = False) -> dict:
        d = asdict(self)
        if not keep_text:
            d.pop("text")
        return d


def build_payload(config: ClientConfig, model: str, prompt: str | list[int], max_tokens: int) -> dict:
    """The JSON body of one streaming request. Token-id prompts need the completions endpoint."""
    body: dict = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        if not isinstance(prompt, str):
            raise ValueError("token-id prompts need --endpoint completions (chat takes text)")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if config.length_controls:
        body["ignore_eos"] = True
        body["min_tokens"] = max_tokens
        body["stream_options"]["continuous_usage_stats"] = True
    body.update(config.extra_body)
    return body


class StreamingClient:
    """Streams up to `max_connections` requests at once; use `async with`.

    Each concurrent stream gets its own one-connection httpx client (a *lane*): httpx's shared pool
    re-scans every connection on every request event, which at 128+ concurrent streams cost more
    CPU than reading the streams (a single client process then measured its own lag as TTFT).
    """

    def __init__(self, config: ClientConfig, max_connections: int = 1, tokenizer=None):
        self.config = config
        self.tokenizer = tokenizer
        self.model = config.model
        self.notes: list[str] = []
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._ssl = ssl.create_default_context()  # shared: building one per lane costs ~20 ms each
        self._max_lanes = max(1, max_connections)
        self._lanes: list[httpx.AsyncClient] = []
        self._idle: list[httpx.AsyncClient] = []
        self._freed: asyncio.Event | None = None
        self._http = self._new_lane()

    def _new_lane(self) -> httpx.AsyncClient:
        lane = httpx.AsyncClient(
            headers=self._headers,
            timeout=httpx.Timeout(self.config.request_timeout_s, connect=self.config.connect_timeout_s),
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            verify=self._ssl,
        )
        self._lanes.append(lane)
        return lane

    async def _take_lane(self) -> httpx.AsyncClient:
        """An idle lane, a new one while fewer than max_connections exist, else waits for one."""
        while True:
            if self._idle:
                return self._idle.pop()
            if len(self._lanes) < self._max_lanes + 1:  # + 1: self._http serves side requests too
                return self._new_lane()
            if self._freed is None:
                self._freed = asyncio.Event()
            self._freed.clear()
            await self._freed.wait()

    def _return_lane(self, lane: httpx.AsyncClient) -> None:
        self._idle.append(lane)
        if self._freed is not None:
            self._freed.set()

    @property
    def http(self) -> httpx.AsyncClient:
        """A client for side requests such as /metrics scrapes (not one of the streaming lanes)."""
        return self._http

    async def __aenter__(self) -> StreamingClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for lane in self._lanes:
            await lane.aclose()

    async def wait_until_ready(self, timeout_s: float) -> None:
        """Poll /v1/models until the server answers; pick the model if none was given.

        Raises ServerUnreachable naming the URL and the last error after `timeout_s` seconds.
        """
        deadline = time.monotonic() + timeout_s
        last_error = "no attempt"
        while True:
            try:
                response = await self._http.get(self.config.url + "/v1/models", timeout=max(0.5, timeout_s))
                if response.status_code == 200:
                    ids = [m.get("id") for m in response.json().get("data", []) if m.get("id")]
                    if self.model is None and ids:
                        self.model = ids[0]
                    break
                last_error = f"HTTP {response.status_code}"
                if response.status_code in (401, 403):
                    raise ServerRejected(
                        f"{self.config.url} refused /v1/models ({last_error}): pass --api-key"
                    )
            except (httpx.TransportError, ValueError) as e:
                last_error = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise ServerUnreachable(
                    f"no OpenAI-compatible server answered at {self.config.url}/v1/models within "
                    f"{timeout_s:g}s (last error: {last_error}). Start one (`tpfuse serve`) or fix --url."
                )
            await asyncio.sleep(0.2)
        if self.model is None:
            raise ServerRejected(f"{self.config.url}/v1/models lists no model: pass --model NAME")

    async def probe(self, prompt: str | list[int]) -> None:
        """Send one short request; if the server rejects the length-control fields, drop them.

        Raises ServerRejected when even the plain request fails (wrong endpoint, model or prompt).
        """
        record = await self.send(-1, prompt, 2, origin=time.perf_counter(), scheduled_s=0.0)
        if record.ok:
            return
        if self.config.length_controls and record.error.startswith(("HTTP 400", "HTTP 422")):
            self.config.length_controls = False
            retry = await self.send(-1, prompt, 2, origin=time.perf_counter(), scheduled_s=0.0)
            if retry.ok:
                self.notes.append(
                    "server rejected " + ", ".join(LENGTH_CONTROL_FIELDS) + f" ({record.error[:120]}); "
                    "sent without them, so outputs may stop early and chunk token counts are estimated"
                )
                return
            record = retry
        hint = " (try --endpoint chat)" if record.error.startswith("HTTP 404") else ""
        raise ServerRejected(f"{self.config.endpoint_url()} refused a probe request: {record.error}{hint}")

    async def send(
        self, request_id: int, prompt: str | list[int], max_tokens: int, origin: float, scheduled_s: float
    ) -> RequestRecord:
        """Stream one request; never raises for a failed request (the record carries the error)."""
        record = RequestRecord(request_id, max_tokens, scheduled_s)
        chunks: list[tuple[float, str, int | None]] = []  # (time, text, cumulative usage tokens)
        try:
            body = build_payload(self.config, self.model or "", prompt, max_tokens)
            lane = await self._take_lane()
            try:
                record.start_s = time.perf_counter() - origin
                async with lane.stream("POST", self.config.endpoint_url(), json=body) as response:
                    if response.status_code != 200:
                        detail = (await response.aread()).decode(errors="replace").strip()
                        record.error = f"HTTP {response.status_code}: {detail[:300]}"
                    else:
                        await self._read_stream(response, record, chunks, origin)
            finally:
                self._return_lane(lane)
        except (httpx.HTTPError, OSError, ValueError) as e:
            record.error = f"{type(e).__name__}: {e}"
        record.end_s = time.perf_counter() - origin
        _count_chunk_tokens(record, chunks, self.tokenizer)
        return record

    async def _read_stream(self, response, record: RequestRecord, chunks: list, origin: float) -> None:
        pending = b""
        done = False
        async for piece in response.aiter_bytes():
            now = time.perf_counter() - origin
            *lines, pending = (pending + piece).split(b"\n")
            for line in lines:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if event.get("error"):
                    record.error = f"server error in stream: {json.dumps(event['error'])[:300]}"
                    return
                _take_event(event, now, record, chunks)
        if not done:
            record.error = "stream ended without data: [DONE]"


def _take_event(event: dict, now: float, record: RequestRecord, chunks: list) -> None:
    usage = event.get("usage") or {}
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        record.completion_tokens = usage.get("completion_tokens", record.completion_tokens)
    text = ""
    choices = event.get("choices") or []
    for choice in choices:
        delta = choice.get("delta") or {}
        text += choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
    cumulative = usage.get("completion_tokens") if usage else None
    previous = next((c[2] for c in reversed(chunks) if c[2] is not None), 0)
    # A usage-only event (no choices) closes the stream; it carries totals, not new tokens.
    if text or (choices and cumulative is not None and cumulative > previous):
        chunks.append((now, text, cumulative))
        record.text += text
        if record.first_token_s is None:
            record.first_token_s = now


def _count_chunk_tokens(record: RequestRecord, chunks: list, tokenizer) -> None:
    """Tokens per chunk: usage deltas when the server streams usage in every chunk, else the client
    tokenizer on each chunk's text, else one per chunk; estimates are scaled to the usage total."""
    record.chunk_times_s = [c[0] for c in chunks]
    if tokenizer is not None and record.text:
        record.client_completion_tokens = len(tokenizer.encode(record.text))
    if chunks and all(c[2] is not None for c in chunks):
        cumulative = [0] + [c[2] for c in chunks]
        record.chunk_tokens = [float(b - a) for a, b in zip(cumulative, cumulative[1:], strict=False)]
        record.chunk_tokens_source = "usage_delta"
        return
    if tokenizer is not None:
        record.chunk_tokens = [float(max(1, len(tokenizer.encode(c[1])))) for c in chunks]
        record.chunk_tokens_source = "client_tokenizer"
    else:
        record.chunk_tokens = [1.0] * len(chunks)
        record.chunk_tokens_source = "one_per_chunk"
    total = sum(record.chunk_tokens)
    if record.completion_tokens and total and total != record.completion_tokens:
        scale = record.completion_tokens / total
        record.chunk_tokens = [n * scale for n in record.chunk_tokens]
        record.chunk_tokens_source += "_scaled_to_usage"
