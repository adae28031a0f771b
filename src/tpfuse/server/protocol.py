"""OpenAI request parsing and response shapes, as plain dicts (no pydantic).

Parsing checks every field's type and range and raises RequestError naming the field, so the app
can answer 400 with an OpenAI-style error body before anything reaches the engine. Limits that
depend on the engine (the context length) are checked in `sampling_params_for`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpfuse.engine.sampling_params import SamplingParams

MAX_STOP_STRINGS = 16


class RequestError(ValueError):
    """A client error: `status` is the HTTP code, `param` the offending field (or None)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def error_body(message: str, param: str | None = None, type: str = "invalid_request_error", code=None):
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(slots=True)
class GenerateRequest:
    """One validated /v1/completions or /v1/chat/completions request."""

    kind: str  # "completion" | "chat"
    model: str
    prompt: str | None = None  # completions: text ...
    prompt_token_ids: list[int] | None = None  # ... or token ids
    messages: list[dict] | None = None  # chat: [{"role", "content": str}]
    max_tokens: int | None = None  # None: the rest of the context (chat only)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _get(body: dict, name: str, check, expected: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise RequestError(f"'{name}' must be {expected}, got {value!r}", param=name)
    return value


def _common_fields(body: dict, req: GenerateRequest) -> None:
    req.temperature = float(_get(body, "temperature", _is_number, "a number >= 0", 1.0))
    if req.temperature < 0:
        raise RequestError(f"'temperature' must be >= 0 (0 is greedy), got {req.temperature}", "temperature")
    req.top_p = float(_get(body, "top_p", _is_number, "a number in (0, 1]", 1.0))
    if not 0.0 < req.top_p <= 1.0:
        raise RequestError(f"'top_p' must lie in (0, 1], got {req.top_p}", "top_p")
    top_k = _get(body, "top_k", _is_int, "an integer (-1 or 0 switch it off)", -1)
    if top_k < -1:
        raise RequestError(f"'top_k' must be -1, 0 (off) or positive, got {top_k}", "top_k")
    req.top_k = -1 if top_k == 0 else top_k
    req.seed = _get(body, "seed", _is_int, "an integer")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    valid = isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
    if stop is not None and (not valid or len(stop) > MAX_STOP_STRINGS):
        raise RequestError(
            f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} such strings, "
            f"got {stop!r}",
            "stop",
        )
    req.stop = stop or []
    ids = _get(body, "stop_token_ids", lambda v: isinstance(v, list), "a list of token ids", [])
    if not all(_is_int(t) and t >= 0 for t in ids):
        raise RequestError(f"'stop_token_ids' must be non-negative integers, got {ids!r}", "stop_token_ids")
    req.stop_token_ids = ids
    req.min_tokens = _get(body, "min_tokens", _is_int, "an integer >= 0", 0)
    if req.min_tokens < 0:
        raise RequestError(f"'min_tokens' must be >= 0, got {req.min_tokens}", "min_tokens")
    req.ignore_eos = _get(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False)
    req.stream = _get(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("'stream_options.include_usage' must be a boolean", "stream_options")
    req.include_usage = include_usage and req.stream
    continuous = options.get("continuous_usage_stats", False)
    if not isinstance(continuous, bool):
        raise RequestError("'stream_options.continuous_usage_stats' must be a boolean", "stream_options")
    req.continuous_usage = continuous and req.stream
    if _get(body, "n", _is_int, "an integer", 1) != 1:
        raise RequestError("'n' must be 1: send one request per completion", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, _is_number, "a number", 0) != 0:
            raise RequestError(f"'{name}' is not supported; leave it out or set it to 0", name)
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise RequestError("'logprobs' is not supported; leave it out", "logprobs")
    if body.get("echo") not in (None, False):
        raise RequestError("'echo' is not supported; leave it out", "echo")


def _model(body: dict, model_names: list[str]) -> str:
    model = body.get("model")
    if model is None:
        return model_names[0]
    if not isinstance(model, str) or model not in model_names:
        raise RequestError(
            f"model {model!r} does not exist; this server serves {', '.join(model_names)}",
            param="model",
            code="model_not_found",
        )
    return model


def _max_tokens(body: dict, name: str, default):
    value = _get(body, name, _is_int, "a positive integer", default)
    if value is not None and value <= 0:
        raise RequestError(f"'{name}' must be >= 1, got {value}", param="max_tokens")
    return value


def _require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def parse_completion_request(body: Any, model_names: list[str]) -> GenerateRequest:
    """Validates a /v1/completions body. prompt: a non-empty string or token-id list (or a list of
    exactly one of those). Raises RequestError naming the field."""
    body = _require_object(body)
    req = GenerateRequest(kind="completion", model=_model(body, model_names))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        req.prompt_token_ids = prompt
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise RequestError("only one prompt per request is supported; send one request each", "prompt")
    else:
        raise RequestError(
            f"'prompt' must be a non-empty string or a non-empty list of token ids, got {prompt!r}", "prompt"
        )
    req.max_tokens = _max_tokens(body, "max_tokens", 16)
    _common_fields(body, req)
    return req


def _message_text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise RequestError(
        f"messages[{index}].content must be a string or a list of text parts", f"messages[{index}].content"
    )


def parse_chat_request(body: Any, model_names: list[str]) -> GenerateRequest:
    """Validates a /v1/chat/completions body: messages is a non-empty list of {role, content}.
    Raises RequestError naming the field."""
    body = _require_object(body)
    req = GenerateRequest(kind="chat", model=_model(body, model_names))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"'messages' must be a non-empty list of messages, got {messages!r}", "messages")
    req.messages = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise RequestError(
                f"messages[{i}] must be an object with a role of system, user or assistant",
                f"messages[{i}].role",
            )
        role = "system" if m["role"] == "developer" else m["role"]
        req.messages.append({"role": role, "content": _message_text(m.get("content"), i)})
    if body.get("max_completion_tokens") is not None:
        req.max_tokens = _max_tokens(body, "max_completion_tokens", None)
    else:
        req.max_tokens = _max_tokens(body, "max_tokens", None)
    _common_fields(body, req)
    return req


def sampling_params_for(req: GenerateRequest, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """Checks the request against the context length and builds its SamplingParams.
    Raises RequestError naming the field: a prompt that leaves no room for one token, or
    prompt + max_tokens beyond max_model_len."""
    prompt_field = "messages" if req.kind == "chat" else "prompt"
    if num_prompt_tokens == 0:
        raise RequestError(f"'{prompt_field}' encodes to no tokens; send some text", prompt_field)
    if num_prompt_tokens >= max_model_len:
        raise RequestError(
            f"the prompt has {num_prompt_tokens} tokens but the context holds {max_model_len} "
            "(prompt + at least one new token); shorten it",
            prompt_field,
        )
    room = max_model_len - num_prompt_tokens
    max_tokens = room if req.max_tokens is None else req.max_tokens
    if max_tokens > room:
        raise RequestError(
            f"'max_tokens' is {max_tokens} but the prompt has {num_prompt_tokens} tokens and the context "
            f"holds {max_model_len}: at most {room} new tokens fit",
            "max_tokens",
        )
    if req.min_tokens > max_tokens:
        raise RequestError(f"'min_tokens' ({req.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
    return SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        seed=req.seed,
        stop=list(req.stop),
        stop_token_ids=list(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
    )
