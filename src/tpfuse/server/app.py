"""The FastAPI app: OpenAI-compatible endpoints over an EngineClient.

Bodies are decoded and validated by the server itself (request_body.py, then the pydantic models of
schemas.py through protocol.py) so that every bad input is a 400 with an OpenAI-style error body
naming the field, never a framework 422; /openapi.json still declares every body. /v1/* and
/metrics need the API key when one is set. A 500 says only that it is one (the traceback goes to
the log); SSE data escapes the characters some clients split lines on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tpfuse.config import ServerConfig
from tpfuse.server import protocol, responses
from tpfuse.server.choices import Choices, choice_seed, sse
from tpfuse.server.engine_client import EngineClient, EngineDied
from tpfuse.server.errors import RequestError, error_body
from tpfuse.server.generation import Generation
from tpfuse.server.metrics import ServerMetrics
from tpfuse.server.protocol import GenerateRequest
from tpfuse.server.request_body import decode_json_body, printable
from tpfuse.server.response_schemas import SCHEMAS as RESPONSE_SCHEMAS
from tpfuse.server.schemas import REQUEST_MODELS

DISCONNECT_POLL_S = 0.5
TOKENIZE_INLINE_CHARS = 1 << 16  # longer prompts are tokenized in a thread, so streams keep flowing
logger = logging.getLogger("tpfuse.server")


# What /openapi.json declares beyond FastAPI's defaults: request bodies (schemas.py) and answers
# (response_schemas.py), by name under components/schemas.
def _schema_ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(description: str, schema: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _schema_ref(schema)}}}


def _request_body_schema(model_name: str) -> dict:
    content = {"application/json": {"schema": _schema_ref(model_name)}}
    return {"requestBody": {"required": True, "content": content}}


def _errors(*statuses: int) -> dict:
    """FastAPI `responses` for the error statuses a route answers, each with the error body."""
    described = {400: "invalid request (the message names the field)", 401: "missing or wrong API key",
                 503: "the engine is loading, stopping or restarting"}  # fmt: skip
    return {status: _json(described[status], "ErrorResponse") for status in statuses}


def _generation_responses(body: str) -> dict:
    """A generation route's answers: the body (a response_schemas name), or server-sent events."""
    content = {"application/json": {"schema": _schema_ref(body)}, "text/event-stream": {}}
    return {200: {"description": "the response; with stream, server-sent events", "content": content},
            **_errors(400, 401, 503)}  # fmt: skip


_STATUS_SCHEMA = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}


def _nullable(prop: dict) -> dict:
    """The property schema that also admits null (its keywords of documentation kept outside)."""
    if prop.get("type") == "null" or any(option.get("type") == "null" for option in prop.get("anyOf", [])):
        return prop
    notes = {k: prop[k] for k in ("title", "description", "default") if k in prop}
    value = {k: v for k, v in prop.items() if k not in notes}
    return {"anyOf": [value, {"type": "null"}], **notes}


def _install_request_schemas(app: FastAPI, model_names: list[str]) -> None:
    """Adds the request models (and what they reference) to the components of /openapi.json, with
    `model` limited to the names this server serves."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            _, definitions = models_json_schema(
                [(m, "validation") for m in REQUEST_MODELS], ref_template="#/components/schemas/{model}"
            )
            for model in REQUEST_MODELS:
                properties = definitions["$defs"][model.__name__]["properties"]
                properties["model"]["anyOf"][0]["enum"] = model_names
                for name, prop in properties.items():  # protocol._validate: a null field means its default
                    if name not in definitions["$defs"][model.__name__].get("required", []):
                        properties[name] = _nullable(prop)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(definitions["$defs"])
            components.update(RESPONSE_SCHEMAS)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _error(status: int, message: str, param=None, type="invalid_request_error", code=None) -> JSONResponse:
    """An OpenAI-style error; any lone surrogate a client sent is escaped (UTF-8 cannot carry it)."""
    param = printable(param) if param is not None else None
    return JSONResponse(error_body(printable(message), param, type, code), status_code=status)


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
    app.state.draining = False  # set on shutdown: new requests get 503
    _install_request_schemas(app, model_names)
    if server_config.cors_allow_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=server_config.cors_allow_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = _error(exc.status_code, str(exc.detail), type=kind)
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def internal_error(request, exc):
        metrics.request_errors.labels("500").inc()
        logger.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return _error(500, "internal server error (the server log has the details)", type="internal_error")

    def check_api_key(request: Request) -> JSONResponse | None:
        if server_config.api_key is None:
            return None
        header = request.headers.get("authorization", "")  # Latin-1 text of the header's bytes
        scheme, _, key = header.partition(" ")
        expected = server_config.api_key.encode("utf-8")
        if scheme.lower() == "bearer" and secrets.compare_digest(key.strip().encode("latin-1"), expected):
            return None
        metrics.request_errors.labels("401").inc()
        return _error(
            401,
            "missing or wrong API key; send 'Authorization: Bearer <key>'",
            type="authentication_error",
            code="invalid_api_key",
        )

    @app.get(
        "/health",
        responses={
            503: {
                "description": "loading, stopping or restarting",
                "content": {"application/json": {"schema": _STATUS_SCHEMA}},
            }
        },
    )
    async def health():
        if app.state.draining:
            return JSONResponse({"status": "stopping"}, status_code=503)
        if not client.is_ready:
            return JSONResponse({"status": client.state}, status_code=503)
        return {"status": "ok"}

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus text format"}, **_errors(401)},
    )
    async def prometheus_metrics(request: Request):
        if (denied := check_api_key(request)) is not None:
            return denied
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", responses={200: _json("the served models", "ModelList"), **_errors(401)})
    async def models(request: Request):
        if (denied := check_api_key(request)) is not None:
            return denied
        return responses.models_response(model_names, created)

    async def generate(request: Request, kind: str):
        arrival = time.perf_counter()
        if (denied := check_api_key(request)) is not None:
            return denied
        try:
            if app.state.draining:
                return _error(503, "the server is shutting down", type="service_unavailable")
            if not client.is_ready:
                return _error(503, client.unavailable_reason(), type="service_unavailable")
            try:
                body = decode_json_body(await request.body())
            except ClientDisconnect:
                raise ClientGone from None
            parse = protocol.parse_chat_request if kind == "chat" else protocol.parse_completion_request
            req = parse(body, model_names)
            info = client.info
            if _prompt_chars(req) > TOKENIZE_INLINE_CHARS:  # long texts: off the event loop
                prompt_ids = await asyncio.to_thread(_tokenize, req, info.tokenizer)
            else:
                prompt_ids = _tokenize(req, info.tokenizer)
            params = protocol.sampling_params_for(req, len(prompt_ids), info.max_model_len, info.vocab_size)
            response_id = responses.new_response_id(kind)
            gens = [
                Generation(
                    client,
                    info.tokenizer,
                    metrics,
                    kind,
                    f"{response_id}-{i}",
                    prompt_ids,
                    dataclasses.replace(params, seed=choice_seed(params.seed, i)),
                    arrival,
                )
                for i in range(req.n)
            ]
            choices = Choices(gens, req, info.tokenizer)
            await _unless_disconnected(request, choices.start())
        except ClientGone:
            return Response(status_code=499)
        except RequestError as exc:
            metrics.request_errors.labels(str(exc.status)).inc()
            return _error(exc.status, exc.message, exc.param, code=exc.code)
        except EngineDied as exc:
            metrics.request_errors.labels("503").inc()
            return _error(503, str(exc), type="service_unavailable")
        if req.stream:
            return StreamingResponse(_stream(choices, response_id), media_type="text/event-stream")
        return await _complete(request, choices)

    @app.post(
        "/v1/completions",
        openapi_extra=_request_body_schema("CompletionRequest"),
        responses=_generation_responses("CompletionResponse"),
    )
    async def completions(request: Request):
        return await generate(request, "completion")

    @app.post(
        "/v1/chat/completions",
        openapi_extra=_request_body_schema("ChatCompletionRequest"),
        responses=_generation_responses("ChatCompletionResponse"),
    )
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


def _prompt_chars(req: GenerateRequest) -> int:
    if req.prompt is not None:
        return len(req.prompt)
    return sum(len(m["content"]) for m in req.messages or [])


def _tokenize(req: GenerateRequest, tokenizer) -> list[int]:
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    if req.kind == "completion":
        return tokenizer.encode(req.prompt)
    try:
        text = tokenizer.apply_chat_template(req.messages)
    except Exception as exc:  # a template may refuse an order of roles (jinja raises its own errors)
        raise RequestError(f"the model's chat template refused the messages: {exc}", "messages") from None
    return tokenizer.encode(text)


async def _complete(request: Request, choices: Choices):
    """The whole response; aborts the request if the client disconnects meanwhile."""
    try:
        return JSONResponse(await _unless_disconnected(request, choices.complete()))
    except ClientGone:
        return Response(status_code=499)
    except EngineDied as exc:
        return _error(503, str(exc), type="service_unavailable")


async def _stream(choices: Choices, response_id: str):
    """Choices.stream, ending with an error event if the engine fails it, then [DONE]."""
    try:
        async for event in choices.stream(response_id):
            yield event
    except EngineDied as exc:
        yield sse(error_body(str(exc), type="service_unavailable"))
    yield "data: [DONE]\n\n"
