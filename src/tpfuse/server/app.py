"""The FastAPI app: OpenAI-compatible endpoints over an EngineClient.

Bodies are parsed by hand (server/protocol.py) so that every bad input is a 400 with an OpenAI-style
error body naming the field, never a framework 422. /v1/* needs the API key when one is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tpfuse.config import ServerConfig
from tpfuse.server import protocol, responses
from tpfuse.server.engine_process import EngineClient, EngineDied
from tpfuse.server.generation import Generation
from tpfuse.server.metrics import ServerMetrics
from tpfuse.server.protocol import GenerateRequest, RequestError, error_body

DISCONNECT_POLL_S = 0.5


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _error(status: int, message: str, param=None, type="invalid_request_error", code=None) -> JSONResponse:
    return JSONResponse(error_body(message, param, type, code), status_code=status)


def build_app(client: EngineClient, server_config: ServerConfig, model_names: list[str]) -> FastAPI:
    """The app for one engine. model_names: the names /v1/models lists and requests may use."""
    metrics = ServerMetrics(lambda: client.stats)
    created = responses.now()

    @asynccontextmanager
    async def lifespan(app):
        client.attach(asyncio.get_running_loop())
        yield

    app = FastAPI(title="tpfuse", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.metrics = metrics

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), type=kind)

    @app.exception_handler(Exception)
    async def internal_error(request, exc):
        metrics.request_errors.labels("500").inc()
        return _error(500, f"internal server error: {type(exc).__name__}: {exc}", type="internal_error")

    def check_api_key(request: Request) -> JSONResponse | None:
        if server_config.api_key is None:
            return None
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(key.strip(), server_config.api_key):
            return None
        metrics.request_errors.labels("401").inc()
        return _error(
            401,
            "missing or wrong API key; send 'Authorization: Bearer <key>'",
            type="authentication_error",
            code="invalid_api_key",
        )

    @app.get("/health")
    async def health():
        if client.failure is not None:
            return JSONResponse({"status": "failed", "reason": client.failure}, status_code=503)
        if not client.is_ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        if (denied := check_api_key(request)) is not None:
            return denied
        return responses.models_response(model_names, created)

    async def generate(request: Request, kind: str):
        arrival = time.perf_counter()
        if (denied := check_api_key(request)) is not None:
            return denied
        try:
            if not client.is_ready:
                reason = client.failure or "the engine is still loading; retry when /health answers 200"
                return _error(503, reason, type="service_unavailable")
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise RequestError(f"the request body is not valid JSON: {exc}") from None
            parse = protocol.parse_chat_request if kind == "chat" else protocol.parse_completion_request
            req = parse(body, model_names)
            prompt_ids = _tokenize(req, client)
            params = protocol.sampling_params_for(req, len(prompt_ids), client.info.max_model_len)
            gen = Generation(
                client,
                client.info.tokenizer,
                metrics,
                kind,
                responses.new_response_id(kind),
                prompt_ids,
                params,
                arrival,
            )
            await _unless_disconnected(request, gen.start())
        except ClientGone:
            return Response(status_code=499)
        except RequestError as exc:
            metrics.request_errors.labels(str(exc.status)).inc()
            return _error(exc.status, exc.message, exc.param, code=exc.code)
        except EngineDied as exc:
            metrics.request_errors.labels("503").inc()
            return _error(503, str(exc), type="service_unavailable")
        if req.stream:
            return StreamingResponse(_stream(gen, req), media_type="text/event-stream")
        return await _complete(request, gen, req)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    return app


class ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, coroutine):
    """Awaits coroutine, cancelling it (which aborts its request) if the client disconnects first.
    Raises ClientGone then."""
    task = asyncio.ensure_future(coroutine)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientGone


def _tokenize(req: GenerateRequest, client: EngineClient) -> list[int]:
    tokenizer = client.info.tokenizer
    if req.prompt_token_ids is not None:
        vocab_size = client.info.vocab_size
        if vocab_size is not None and max(req.prompt_token_ids) >= vocab_size:
            raise RequestError(f"'prompt' holds token ids >= the vocabulary size {vocab_size}", "prompt")
        return list(req.prompt_token_ids)
    text = req.prompt if req.kind == "completion" else tokenizer.apply_chat_template(req.messages)
    return tokenizer.encode(text)


def _usage(gen: Generation) -> dict:
    return responses.usage(gen.num_prompt_tokens, gen.num_completion_tokens, gen.num_cached_tokens)


async def _complete(request: Request, gen: Generation, req: GenerateRequest):
    """Collects the whole text; aborts the request if the client disconnects meanwhile."""

    async def collect():
        parts = []
        async for piece in gen.pieces():
            parts.append(piece.text)
        return "".join(parts)

    try:
        text = await _unless_disconnected(request, collect())
    except ClientGone:
        return Response(status_code=499)
    except EngineDied as exc:
        return _error(503, str(exc), type="service_unavailable")
    created = responses.now()
    body = responses.full_response(
        req.kind, gen.request_id, created, req.model, text, gen.finish_reason, _usage(gen)
    )
    return JSONResponse(body)


async def _stream(gen: Generation, req: GenerateRequest):
    """SSE events: one chunk per text piece (the last carries finish_reason), the usage chunk when
    asked for, then [DONE]. With continuous_usage_stats every engine output is a chunk (even when
    its text is held back) carrying the cumulative usage, so clients can time each token.
    Leaving early (client gone) closes gen.pieces(), which aborts."""
    created = responses.now()
    first = True
    pieces = gen.pieces()
    try:
        async for piece in pieces:
            if not piece.text and piece.finish_reason is None and not req.continuous_usage:
                continue
            usage = _usage(gen) if req.continuous_usage else None
            chunk = responses.chunk(
                req.kind, gen.request_id, created, req.model, piece.text, piece.finish_reason, first, usage
            )
            first = False
            yield f"data: {_dumps(chunk)}\n\n"
        if req.include_usage:
            last = responses.usage_chunk(req.kind, gen.request_id, created, req.model, _usage(gen))
            yield f"data: {_dumps(last)}\n\n"
    except EngineDied as exc:
        yield f"data: {_dumps(error_body(str(exc), type='service_unavailable'))}\n\n"
    finally:
        await pieces.aclose()
    yield "data: [DONE]\n\n"
