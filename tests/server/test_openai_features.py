"""The OpenAI fields clients send, on the tiny random model: constrained JSON (only a grammar makes
random weights write it), forced tool calls, n choices, logprobs, logit_bias and penalties."""

import json

import httpx
import jsonschema
import pytest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
        },
    },
}
USER = [{"role": "user", "content": "Reply in JSON."}]


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=300) as client:
        yield client


def _chat(http, **fields) -> dict:
    response = http.post("/v1/chat/completions", json={"messages": USER, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def _stream_chunks(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def test_json_object_response_parses_as_json(http):
    result = _chat(
        http, response_format={"type": "json_object"}, n=3, seed=3, temperature=1.0, max_tokens=200
    )
    finished = [c for c in result["choices"] if c["finish_reason"] == "stop"]
    assert finished, result  # the tokens ran out for the others: a JSON text cut short
    for choice in finished:
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    assert any(len(json.loads(c["message"]["content"])) > 0 for c in finished), finished


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_response_validates_against_its_schema(http, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    result = _chat(http, response_format=fmt, temperature=temperature, seed=1, max_tokens=200)
    assert result["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(result["choices"][0]["message"]["content"]), PERSON)


@pytest.mark.parametrize(
    "tool_choice, parallel",
    [({"type": "function", "function": {"name": "get_weather"}}, False), ("required", True)],
)
def test_forced_tool_call_parses_into_tool_calls_matching_the_schema(http, tool_choice, parallel):
    result = _chat(
        http, tools=[WEATHER, TIME], tool_choice=tool_choice, parallel_tool_calls=parallel, max_tokens=1000
    )
    choice = result["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert calls and (parallel or len(calls) == 1)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        if not isinstance(tool_choice, str):
            assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_streamed_tool_call_carries_the_same_calls(http):
    body = {
        "messages": USER,
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 200,
        "temperature": 0,
    }
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"]
    chunks = _stream_chunks(http, "/v1/chat/completions", body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [c["function"] for c in streamed] == [c["function"] for c in whole]
    assert [c["index"] for c in streamed] == list(range(len(whole)))
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_n_3_with_a_seed_gives_three_distinct_reproducible_answers(http):
    body = {"prompt": "Once", "n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 8, "ignore_eos": True}
    first = http.post("/v1/completions", json=body).json()
    second = http.post("/v1/completions", json=body).json()
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert len(set(texts)) == 3 and texts == [c["text"] for c in second["choices"]]
    assert first["usage"]["completion_tokens"] == 24
    streamed = _stream_chunks(http, "/v1/completions", body)
    by_index = ["", "", ""]
    for chunk in streamed:
        for choice in chunk["choices"]:
            by_index[choice["index"]] += choice["text"]
    assert by_index == texts


def test_completion_logprobs_have_the_chosen_token_and_the_top_k(http):
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    logprobs = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
    for chosen, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
        assert len(top) <= 3 and chosen == pytest.approx(max(top.values())) and chosen <= 0  # greedy


def test_chat_logprobs_stream_one_entry_per_token(http):
    body = {"messages": USER, "max_tokens": 5, "logprobs": True, "top_logprobs": 2, "temperature": 0}
    body["stream_options"] = {"include_usage": True}
    chunks = _stream_chunks(http, "/v1/chat/completions", {**body, "ignore_eos": True})
    entries = [
        e
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert len(entries) == chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(
        len(e["top_logprobs"]) == 2 and e["logprob"] == e["top_logprobs"][0]["logprob"] for e in entries
    )


def test_logit_bias_forces_and_forbids_tokens(http):
    body = {"prompt": "Hi", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    forced = http.post("/v1/completions", json={**body, "logit_bias": {str(ord("Z")): 100}}).json()
    assert forced["choices"][0]["text"] == "Z" * 6
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    first = plain.encode()[0]
    assert first < 0x80  # an ASCII token: its text is its byte
    text = http.post("/v1/completions", json={**body, "logit_bias": {str(first): -100}}).json()["choices"][0][
        "text"
    ]
    assert text.encode()[0] != first


def test_penalties_change_a_repetitive_greedy_answer(http):
    body = {"prompt": "aaaa", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    for name, value in (("frequency_penalty", 2.0), ("presence_penalty", 2.0), ("repetition_penalty", 5.0)):
        text = http.post("/v1/completions", json={**body, name: value}).json()["choices"][0]["text"]
        assert len(set(text)) > len(set(plain)), (name, text, plain)


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
        ({"logit_bias": {"hello": 1}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
    ],
)
def test_unsupported_combinations_are_400_naming_the_field(http, fields, param):
    response = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize(
    "path,body,declared",
    [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "logprobs": 2, "n": 2}, "CompletionResponse"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 2},
         "ChatCompletionResponse"),
        ("/v1/chat/completions",
         {"messages": USER, "max_tokens": 1000, "tools": [WEATHER], "tool_choice": "required"},
         "ChatCompletionResponse"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "ErrorResponse"),
        ("/v1/models", None, "ModelList"),
    ],
)  # fmt: skip
def test_answers_match_the_schemas_openapi_declares_for_them(http, path, body, declared):
    spec = http.get("/openapi.json").json()
    answer = http.post(path, json=body) if body is not None else http.get(path)
    schema = {"$ref": f"#/components/schemas/{declared}", "components": spec["components"]}
    jsonschema.Draft202012Validator(schema).validate(answer.json())
    if declared == "ErrorResponse":
        assert answer.status_code == 400
    else:
        documented = spec["paths"][path]["post" if body is not None else "get"]["responses"]["200"]
        assert documented["content"]["application/json"]["schema"]["$ref"].endswith(declared)
    if body and body.get("tools"):
        assert answer.json()["choices"][0]["message"]["tool_calls"]  # the tool_calls branch was checked


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}}}],
          "tool_choice": "required"}, "tools"),
    ],
)  # fmt: skip
def test_a_grammar_that_does_not_compile_is_400_naming_its_field_without_internals(http, fields, param):
    response = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "minimum" in error["message"], error
    assert ".cc" not in error["message"] and "[" not in error["message"], error


def test_an_unsatisfiable_schema_ends_the_answer_instead_of_emitting_filler(http):
    """No string matches [^\\s\\S]: once the opening quote is out no token fits, so the answer ends."""
    schema = {"type": "string", "pattern": "[^\\s\\S]"}
    fmt = {"type": "json_schema", "json_schema": {"name": "nothing", "schema": schema}}
    choice = _chat(http, max_tokens=30, temperature=0, response_format=fmt)["choices"][0]
    text = choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and len(text) <= 1, choice
    assert not any(ord(c) < 0x20 for c in text), choice


ORDER = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 2}},
    "required": ["items"],
    "additionalProperties": False,
    "$defs": {
        "Item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "maxLength": 4},
                "qty": {"type": "integer", "minimum": 1},
            },
            "required": ["sku", "qty"],
            "additionalProperties": False,
        }
    },
}


def test_forced_calls_of_functions_whose_parameters_use_defs_validate(http):
    """Parameters with $defs (what pydantic writes for nested models) are moved to the root of the
    calls' schema, where their references resolve."""
    tools = [{"type": "function", "function": {"name": "order", "parameters": ORDER}}, TIME]
    result = _chat(http, tools=tools, tool_choice="required", max_tokens=1000, seed=3)
    calls = result["choices"][0]["message"]["tool_calls"]
    schemas = {"order": ORDER, "get_time": TIME["function"]["parameters"]}
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


@pytest.mark.parametrize(
    "fields,param,where",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
         "response_format", "response_format.json_schema.schema"),
        ({"tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tools", "tools[1].function.parameters.properties.n"),
    ],
)  # fmt: skip
def test_schema_keywords_the_grammar_would_ignore_are_400_naming_where(http, fields, param, where):
    response = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(where), error
