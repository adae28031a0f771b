"""A small OpenAI-compatible streaming server for bench tests, run by uvicorn in a thread.

It streams `max_tokens` tokens (" tok0 tok1 ...", one word per token) when ignore_eos or min_tokens
asks for them, else stops after `natural_length`; reports usage (in every chunk when
stream_options.continuous_usage_stats is set); groups `tokens_per_chunk` tokens per chunk like a
speculative server; and exposes speculative-decoding counters on /metrics. `FakeBehavior` is read on
every request, so a test may change it while the server runs.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

NONSTANDARD_FIELDS = ("ignore_eos", "min_tokens")


@dataclass
class FakeBehavior:
    model: str = "fake-model"
    ttft_s: float = 0.0
    token_delay_s: float = 0.001
    tokens_per_chunk: int = 1
    natural_length: int = 4  # tokens before EOS unless ignore_eos / min_tokens say otherwise
    reject_nonstandard_fields: bool = False  # answer 400 to ignore_eos / min_tokens (strict servers)
    honor_continuous_usage: bool = True
    fail_request_numbers: set[int] = field(default_factory=set)  # 0-based count of completion requests
    usage_offset: int = 0  # report usage this many tokens off (a lying server)
    seen_bodies: list[dict] = field(default_factory=list)


@dataclass
class Counters:
    requests: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0


def make_app(behavior: FakeBehavior, counters: Counters) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": behavior.model, "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        lines = [
            "# TYPE fake:spec_decode_num_drafts_total counter",
            f"fake:spec_decode_num_drafts_total {counters.drafts}",
            f"fake:spec_decode_num_draft_tokens_total {counters.draft_tokens}",
            f"fake:spec_decode_num_accepted_tokens_total {counters.accepted}",
            f"fake:requests_total {counters.requests}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def complete(request: Request, chat: bool):
        body = await request.json()
        behavior.seen_bodies.append(body)
        number = counters.requests
        counters.requests += 1
        if behavior.reject_nonstandard_fields:
            extra = [f for f in NONSTANDARD_FIELDS if f in body]
            extra += (
                ["continuous_usage_stats"]
                if "continuous_usage_stats" in body.get("stream_options", {})
                else []
            )
            if extra:
                return JSONResponse({"error": {"message": f"unknown fields {extra}"}}, status_code=400)
        if number in behavior.fail_request_numbers:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        max_tokens = int(body.get("max_tokens", 16))
        forced = body.get("ignore_eos") or body.get("min_tokens")
        count = max_tokens if forced else min(max_tokens, behavior.natural_length)
        continuous = behavior.honor_continuous_usage and body.get("stream_options", {}).get(
            "continuous_usage_stats"
        )
        return StreamingResponse(
            _stream(behavior, counters, chat, prompt_tokens, count, continuous),
            media_type="text/event-stream",
        )

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    return app


async def _stream(behavior, counters, chat, prompt_tokens, count, continuous):
    def event(text, finish, usage):
        choice = {"index": 0, "finish_reason": finish}
        choice |= {"delta": {"content": text}} if chat else {"text": text}
        payload = {"id": "cmpl-fake", "object": "chunk", "model": behavior.model, "choices": [choice]}
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    def usage(n):
        n_reported = n + behavior.usage_offset
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n_reported,
            "total_tokens": prompt_tokens + n,
        }

    if chat:  # like OpenAI: a role-only chunk first, which carries no token
        role = {
            "id": "cmpl-fake",
            "object": "chunk",
            "model": behavior.model,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
        yield f"data: {json.dumps(role)}\n\n"
    await asyncio.sleep(behavior.ttft_s)
    sent = 0
    while sent < count:
        n = min(behavior.tokens_per_chunk, count - sent)
        if sent > 0:
            await asyncio.sleep(behavior.token_delay_s * n)
            counters.drafts += 1
            counters.draft_tokens += behavior.tokens_per_chunk - 1
            counters.accepted += n - 1
        text = "".join(f" tok{sent + i}" for i in range(n))
        sent += n
        finish = "length" if sent == count else None
        yield event(text, finish, usage(sent) if continuous else None)
    final = {
        "id": "cmpl-fake",
        "object": "chunk",
        "model": behavior.model,
        "choices": [],
        "usage": usage(sent),
    }
    yield f"data: {json.dumps(final)}\n\n"
    yield "data: [DONE]\n\n"


class FakeServer:
    """Start with `with FakeServer(behavior) as server:`; `server.url` is its base URL."""

    def __init__(self, behavior: FakeBehavior | None = None):
        self.behavior = behavior or FakeBehavior()
        self.counters = Counters()
        config = uvicorn.Config(
            make_app(self.behavior, self.counters),
            host="127.0.0.1",
            port=0,
            log_level="error",
            lifespan="off",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self.url = ""

    def __enter__(self) -> FakeServer:
        self._thread.start()
        deadline = time.monotonic() + 10.0
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake server did not start within 10 s")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5.0)
