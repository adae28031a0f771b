"""OpenAI request validation: a body (already decoded by request_body.py) -> GenerateRequest.

Types and ranges come from the pydantic models in schemas.py; a violation is a RequestError naming
the field (`messages[0].role`, `logit_bias`), so the app answers 400 with an OpenAI-style error body
before anything reaches the engine. Limits that depend on the engine (context length, vocabulary)
are checked in `sampling_params_for`. What tpfuse does not support is refused naming the field,
never ignored.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from tpfuse.engine.sampling_params import Grammar, SamplingParams
from tpfuse.server import tool_calls
from tpfuse.server.errors import RequestError
from tpfuse.server.json_schema_support import check_json_schema
from tpfuse.server.schemas import ChatCompletionRequest, CompletionRequest

_FIELD_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_TOKEN_ID = re.compile(r"[0-9]{1,19}", re.ASCII)  # int64; the vocabulary bound comes later
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_UNION_HINTS = {
    "prompt": "a non-empty string or a non-empty list of token ids (or a list of exactly one of those)",
    "stop": "a non-empty string of at most 1024 characters or a list of up to 16 such strings",
    "content": "a string or a list of text parts",
    "tool_choice": '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
}


@dataclass(slots=True)
class GenerateRequest:
    """One validated /v1/completions or /v1/chat/completions request."""

    kind: str  # "completion" | "chat"
    model: str
    prompt: str | None = None  # completions: text ...
    prompt_token_ids: list[int] | None = None  # ... or token ids
    messages: list[dict] | None = None  # chat: [{"role", "content": str}]
    max_tokens: int | None = None  # None: the rest of the context (chat only)
    max_tokens_field: str = "max_tokens"  # the field that carried it
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
    n: int = 1
    logprobs: int | None = None  # None: off; k: the chosen token's logprob and the top k
    logit_bias: dict[int, float] = field(default_factory=dict)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: Grammar | None = None  # response_format or forced tool calls
    tools: tool_calls.ToolChoice | None = None  # chat: tools the model may call


def _param(loc: tuple) -> str | None:
    """A pydantic error location as the field path a client reads: ('messages', 0, 'role') ->
    'messages[0].role'; union member tags are dropped."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and _FIELD_NAME.match(part) and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
    return path or None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _validate(model: type[BaseModel], body: Any) -> BaseModel:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}  # a null field means its default
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        param = _param(error["loc"])
        name = (param or "").rpartition(".")[2].split("[")[0]
        if error["type"] == "extra_forbidden":
            message = f"'{param}' is not a field tpfuse accepts here; leave it out"
        elif error["type"] == "missing":
            message = f"'{param}' is required"
        elif name in _UNION_HINTS:
            message = f"'{param}' must be {_UNION_HINTS[name]}, got {_short(error.get('input'))}"
        else:
            message = f"'{param}': {error['msg']}, got {_short(error.get('input'))}"
        raise RequestError(message, param) from None


def _model_name(model: str | None, model_names: list[str]) -> str:
    if model is None:
        return model_names[0]
    if model not in model_names:
        raise RequestError(
            f"model {model!r} does not exist; this server serves {', '.join(model_names)}",
            param="model",
            code="model_not_found",
        )
    return model


def _unsupported(name: str, hint: str) -> RequestError:
    return RequestError(f"'{name}' is not supported: {hint}", name)


def _common_fields(body, req: GenerateRequest) -> None:
    req.temperature = body.temperature
    req.top_p = body.top_p
    req.top_k = -1 if body.top_k == 0 else body.top_k
    req.seed = body.seed
    req.stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    req.stop_token_ids = list(body.stop_token_ids or [])
    req.min_tokens = body.min_tokens
    req.ignore_eos = body.ignore_eos
    req.stream = body.stream
    options = body.stream_options
    req.include_usage = bool(options and options.include_usage and req.stream)
    req.continuous_usage = bool(options and options.continuous_usage_stats and req.stream)
    req.n = body.n
    req.repetition_penalty = body.repetition_penalty
    req.presence_penalty = body.presence_penalty
    req.frequency_penalty = body.frequency_penalty
    for key, bias in (body.logit_bias or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            raise RequestError(
                f"'logit_bias' keys must be token ids (decimal strings), got {_short(key)}", "logit_bias"
            )
        req.logit_bias[int(key)] = bias
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        req.grammar = Grammar("json_schema", json.dumps({"type": "object"}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise RequestError(
                "'response_format.json_schema' is required with type json_schema", "response_format"
            )
        check_json_schema(fmt.json_schema.schema_, "response_format")
        req.grammar = Grammar("json_schema", json.dumps(fmt.json_schema.schema_))


def _check_grammar_fields(req: GenerateRequest) -> None:
    if req.grammar is None:
        return
    if req.ignore_eos:
        raise RequestError(
            "'ignore_eos' cannot be combined with constrained output (it ends at EOS)", "ignore_eos"
        )
    if req.min_tokens:
        raise RequestError("'min_tokens' cannot be combined with constrained output", "min_tokens")


def parse_completion_request(body: Any, model_names: list[str]) -> GenerateRequest:
    """Validates a /v1/completions body. prompt: a non-empty string or token-id list (or a list of
    exactly one of those). Raises RequestError naming the field."""
    parsed = _validate(CompletionRequest, body)
    req = GenerateRequest(kind="completion", model=_model_name(parsed.model, model_names))
    prompt = parsed.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if not prompt:
        raise RequestError(f"'prompt' must be {_UNION_HINTS['prompt']}, got {_short(prompt)}", "prompt")
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids = list(prompt)
    req.max_tokens = parsed.max_tokens
    req.logprobs = parsed.logprobs
    if parsed.echo:
        raise _unsupported("echo", "leave it out")
    if parsed.suffix:
        raise _unsupported("suffix", "leave it out")
    if parsed.best_of not in (None, parsed.n):
        raise _unsupported("best_of", "leave it out or set it to n")
    _common_fields(parsed, req)
    _check_grammar_fields(req)
    return req


def parse_chat_request(body: Any, model_names: list[str]) -> GenerateRequest:
    """Validates a /v1/chat/completions body: messages is a non-empty list of {role, content}.
    Raises RequestError naming the field."""
    parsed = _validate(ChatCompletionRequest, body)
    req = GenerateRequest(kind="chat", model=_model_name(parsed.model, model_names))
    req.messages = [tool_calls.message_for_template(m) for m in parsed.messages]
    if parsed.max_completion_tokens is not None:
        req.max_tokens, req.max_tokens_field = parsed.max_completion_tokens, "max_completion_tokens"
    else:
        req.max_tokens = parsed.max_tokens
    if parsed.logprobs:
        req.logprobs = parsed.top_logprobs or 0
    elif parsed.top_logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    _common_fields(parsed, req)
    try:
        req.tools = tool_calls.choice_for(parsed.tools, parsed.tool_choice, parsed.parallel_tool_calls)
    except RequestError:
        raise
    except ValueError as exc:
        raise RequestError(str(exc), "tool_choice") from None
    if req.tools is not None:
        tool_calls.add_to_system_message(req.messages, req.tools)
        if req.tools.grammar is not None:
            if req.grammar is not None:
                raise RequestError(
                    "'response_format' cannot be combined with forced tool calls", "response_format"
                )
            req.grammar = req.tools.grammar
    _check_grammar_fields(req)
    return req


def sampling_params_for(
    req: GenerateRequest, num_prompt_tokens: int, max_model_len: int, vocab_size: int | None = None
) -> SamplingParams:
    """Checks the request against the context length and the vocabulary and builds its
    SamplingParams. Raises RequestError naming the field: a prompt that leaves no room for one token,
    prompt + max_tokens beyond max_model_len, token ids outside the vocabulary."""
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
            f"'{req.max_tokens_field}' is {max_tokens} but the prompt has {num_prompt_tokens} tokens and "
            f"the context holds {max_model_len}: at most {room} new tokens fit",
            req.max_tokens_field,
        )
    if req.min_tokens > max_tokens:
        raise RequestError(f"'min_tokens' ({req.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
    top_k = req.top_k
    if vocab_size is not None:
        for name, ids in (("prompt", req.prompt_token_ids or []), ("stop_token_ids", req.stop_token_ids)):
            if ids and max(ids) >= vocab_size:
                raise RequestError(
                    f"'{name}' holds token id {max(ids)}, outside the vocabulary [0, {vocab_size})", name
                )
        if top_k >= vocab_size:
            top_k = -1  # keeps every token: the same as off
    bad = [t for t in req.logit_bias if vocab_size is not None and t >= vocab_size]
    if bad:
        raise RequestError(
            f"'logit_bias' names token {bad[0]}, outside the vocabulary [0, {vocab_size})", "logit_bias"
        )
    return SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=top_k,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        seed=req.seed,
        stop=list(req.stop),
        stop_token_ids=list(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
        logit_bias=dict(req.logit_bias) or None,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        grammar=req.grammar,
    )
