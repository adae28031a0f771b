"""An API fuzzer (schemathesis) driven by the server's own /openapi.json, for a bounded time: every
operation is reached with generated bodies (valid and invalid), no answer is a 5xx, every answer is
one the description declares (status codes, content types, bodies: server/response_schemas.py), and
bodies the schema refuses are refused. Not checked there: that every body the schema admits is
accepted, as two rules span fields and stay out of the schema (tool_choice naming a tool needs
tools; best_of, where given, equals n). The description's other promises are checked directly: null
fields, whole numbers written with a fraction, the methods a path allows."""

import re
import subprocess

import httpx
from tests.server.conftest import API_KEY

FUZZ_SECONDS = 15


def test_openapi_declares_every_request_body_and_field(fake_server):
    spec = httpx.get(fake_server.url + "/openapi.json", timeout=10).json()
    schemas = spec["components"]["schemas"]
    for path, model in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        fields = schemas[model]["properties"]
        assert {"model", "max_tokens", "temperature", "seed", "stop", "stream", "n"} <= set(fields)
        assert schemas[model]["additionalProperties"] is False


def test_schemathesis_finds_no_server_error(fake_server, tmp_path):
    result = subprocess.run(
        ["schemathesis", "run", fake_server.url + "/openapi.json", "--url", fake_server.url,
         "--checks", "all", "--exclude-checks", "positive_data_acceptance", "--phases", "fuzzing",
         "--max-time", str(FUZZ_SECONDS),
         "--seed", "24",
         "-H", f"Authorization: Bearer {API_KEY}"],
        capture_output=True, text=True, timeout=FUZZ_SECONDS + 120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    generated = re.search(r"(\d+) generated", result.stdout)
    assert generated and int(generated.group(1)) >= 100, result.stdout[-3000:]
    assert "Traceback" not in fake_server.output()


def test_the_description_says_what_the_server_accepts_and_answers(fake_server):
    spec = httpx.get(fake_server.url + "/openapi.json", timeout=10).json()
    schemas = spec["components"]["schemas"]
    for path, model in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        required = set(schemas[model].get("required", []))
        for name, prop in schemas[model]["properties"].items():
            nullable = any(option.get("type") == "null" for option in prop.get("anyOf", []))
            assert nullable == (name not in required), (model, name)  # null means the field's default
        answers = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "503"} <= set(answers)
        error = answers["400"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}
        assert schemas["ErrorResponse"]["required"] == ["error"]
        assert {"application/json", "text/event-stream"} <= set(answers["200"]["content"])
    assert "text/plain" in spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"][0]  # required: not nullable
    assert prompt["minLength"] == 1


def test_nulls_whole_numbers_with_a_fraction_and_undeclared_methods(fake_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "abc", "max_tokens": 3.0, "seed": 7.0, "echo": None, "stop": None, "top_k": None}
    answer = httpx.post(fake_server.url + "/v1/completions", json=body, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] <= 3
    answer = httpx.post(
        fake_server.url + "/v1/completions", json={**body, "max_tokens": 3.5}, headers=headers, timeout=30
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "max_tokens"
    answer = httpx.request("TRACE", fake_server.url + "/health", timeout=10)
    assert answer.status_code == 405 and answer.headers["allow"] == "GET"
