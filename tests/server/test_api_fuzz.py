"""An API fuzzer (schemathesis) driven by the server's own /openapi.json, for a bounded time: every
operation is reached with generated bodies (valid and invalid) and no answer is a 5xx."""

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
         "--checks", "not_a_server_error", "--phases", "fuzzing", "--max-time", str(FUZZ_SECONDS),
         "--seed", "24",
         "-H", f"Authorization: Bearer {API_KEY}"],
        capture_output=True, text=True, timeout=FUZZ_SECONDS + 120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    generated = re.search(r"(\d+) generated", result.stdout)
    assert generated and int(generated.group(1)) >= 100, result.stdout[-3000:]
    assert "Traceback" not in fake_server.output()
