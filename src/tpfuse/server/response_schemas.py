"""JSON Schemas of the bodies the server answers with (responses.py and choices.py build them), as
/openapi.json declares them under components/schemas: the full completion and chat completion, the
model list, and the error body every refusal carries. A client can generate its types from them, and
the API fuzz test checks every answer against them."""

from __future__ import annotations

_STRING, _INT, _NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": list(required or properties)}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _token_logprob(top: bool) -> dict:
    properties = {"token": _STRING, "logprob": _NUMBER, "bytes": {"type": "array", "items": _INT}}
    if top:
        properties["top_logprobs"] = {"type": "array", "items": _token_logprob(top=False)}
    return _object(properties)


def _enum(*values: str) -> dict:
    return {"type": "string", "enum": list(values)}


def _response(object_name: str, choice: dict) -> dict:
    """A full (non-streamed) response: the envelope around choices that hold `index` and `choice`."""
    return _object(
        {
            "id": _STRING,
            "object": _enum(object_name),
            "created": _INT,
            "model": _STRING,
            "choices": {"type": "array", "items": _object({"index": _INT, **choice})},
            "usage": _ref("Usage"),
        }
    )


# finish_reason: "stop" (an end or stop id or string), "length" (max_tokens or the context), "abort"
# (the request was cancelled), and for chat "tool_calls" (the output parsed as calls).
_FINISH = ["stop", "length", "abort"]

SCHEMAS = {
    "Usage": _object(
        {
            "prompt_tokens": _INT,
            "completion_tokens": _INT,
            "total_tokens": _INT,
            "prompt_tokens_details": _object({"cached_tokens": _INT}),
        },
        ["prompt_tokens", "completion_tokens", "total_tokens"],
    ),
    "CompletionLogprobs": _object(
        {
            "tokens": {"type": "array", "items": _STRING},
            "token_logprobs": {"type": "array", "items": _NUMBER},
            "top_logprobs": {"type": "array", "items": {"type": "object", "additionalProperties": _NUMBER}},
            "text_offset": {"type": "array", "items": _INT},
        }
    ),
    "ChatLogprobs": _object({"content": {"type": "array", "items": _token_logprob(top=True)}}),
    "ToolCall": _object(
        {
            "id": _STRING,
            "type": {"type": "string", "enum": ["function"]},
            "function": _object({"name": _STRING, "arguments": _STRING}),
        }
    ),
    "CompletionResponse": _response(
        "text_completion",
        {
            "text": _STRING,
            "logprobs": _nullable(_ref("CompletionLogprobs")),
            "finish_reason": _enum(*_FINISH),
        },
    ),
    "ChatCompletionResponse": _response(
        "chat.completion",
        {
            "message": _object(
                {
                    "role": _enum("assistant"),
                    "content": _nullable(_STRING),
                    "tool_calls": {"type": "array", "items": _ref("ToolCall")},
                },
                ["role", "content"],
            ),
            "logprobs": _nullable(_ref("ChatLogprobs")),
            "finish_reason": _enum(*_FINISH, "tool_calls"),
        },
    ),
    "ModelList": _object(
        {
            "object": {"type": "string", "enum": ["list"]},
            "data": {
                "type": "array",
                "items": _object(
                    {
                        "id": _STRING,
                        "object": {"type": "string", "enum": ["model"]},
                        "created": _INT,
                        "owned_by": _STRING,
                    }
                ),
            },
        }
    ),
    "ErrorResponse": _object(
        {
            "error": _object(
                {"message": _STRING, "type": _STRING, "param": _nullable(_STRING), "code": _nullable(_STRING)}
            )
        }
    ),
}
