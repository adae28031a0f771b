"""OpenAI response shapes as plain dicts: full responses, streamed chunks, usage, model list."""

from __future__ import annotations

import time
import uuid


def new_response_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def full_response(kind, response_id, created, model, text, finish_reason, usage_: dict) -> dict:
    """A non-streaming response: object "text_completion" or "chat.completion"."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text}
        obj = "text_completion"
    choice.update(logprobs=None, finish_reason=finish_reason)
    return {
        "id": response_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_,
    }


def chunk(kind, response_id, created, model, text, finish_reason, first: bool = False, usage_=None) -> dict:
    """One streamed chunk; the first chat chunk carries the role; usage_ (cumulative) when asked
    for with stream_options.continuous_usage_stats."""
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        choice = {"index": 0, "delta": delta}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text}
        obj = "text_completion"
    choice.update(logprobs=None, finish_reason=finish_reason)
    body = {"id": response_id, "object": obj, "created": created, "model": model, "choices": [choice]}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def usage_chunk(kind, response_id, created, model, usage_: dict) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, only usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {
        "id": response_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_,
    }


def models_response(model_names: list[str], created: int) -> dict:
    return {
        "object": "list",
        "data": [{"id": m, "object": "model", "created": created, "owned_by": "tpfuse"} for m in model_names],
    }


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(entries, tokenizer, text_offset: int = 0) -> dict:
    """/v1/completions logprobs of TokenLogprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [_token_text(tokenizer, e.token_id) for e in entries]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries, tokenizer) -> dict:
    """/v1/chat/completions logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(token_id: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries
        ]
    }
