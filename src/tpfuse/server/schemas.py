"""The request bodies of /v1/completions and /v1/chat/completions as pydantic models.

They are the one declaration of every field, its type and its range: protocol.py validates bodies
with them (strict types, no unknown fields, finite numbers, bounded lists and strings) and the app
publishes their JSON schema in /openapi.json. Limits that depend on the engine (the context length,
the vocabulary) are checked afterwards, in protocol.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_MESSAGES = 4096
MAX_LOGIT_BIAS = 1024
MAX_TOOLS = 128
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
MAX_PROMPT_CHARS = 8 << 20

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegativeInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
PositiveInt64 = Annotated[int, Field(ge=1, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
PromptText = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="cumulative usage in every chunk (vLLM's name)")


class JsonSchemaFormat(_Strict):
    name: str = Field("response", max_length=256)
    description: str | None = Field(None, max_length=4096)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(_Strict):
    """Fields both endpoints share."""

    model: str | None = Field(None, max_length=1024, description="default: the first served model")
    max_tokens: PositiveInt64 | None = None
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE, description="0 (or below 1e-5) is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=INT64_MAX, description="-1 or 0: off")
    seed: Int64 | None = None
    stop: StopString | StopStrings | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    min_tokens: NonNegativeInt64 = 0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="1: off")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="token id (as a string) -> bias added to its logit"
    )
    response_format: ResponseFormat | None = None
    user: str | None = Field(None, max_length=1024, description="accepted, unused")


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: (
        PromptText
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[PromptText], Field(min_length=1, max_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)]
    ) = Field(description="a non-empty string or token ids (or a list of one of those)")
    max_tokens: PositiveInt64 | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="top logprobs per token")
    echo: bool = False
    suffix: str | None = Field(None, max_length=1024, description="not supported: leave it out")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only 1 (or n) is supported")


class TextPart(_Strict):
    type: Literal["text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class FunctionCall(_Strict):
    name: str = Field(max_length=64)
    arguments: str = Field(max_length=MAX_PROMPT_CHARS)


class ToolCall(_Strict):
    id: str = Field(max_length=256)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=256)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: PositiveInt64 | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest)
