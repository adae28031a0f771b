"""--cors-allow-origins and the API key on /metrics, on the app in-process (no engine needed)."""

from fastapi.testclient import TestClient

from tpfuse.config import ServerConfig
from tpfuse.server.app import build_app


class _IdleClient:
    """What the app reads of an EngineClient for /health and /metrics."""

    state = "ready"
    is_ready = True
    stats: dict = {}

    def attach(self, loop):
        pass


def _app(**config):
    return TestClient(build_app(_IdleClient(), ServerConfig(**config), ["tiny"]))


def test_metrics_needs_the_api_key_when_one_is_set():
    http = _app(api_key="k")
    assert http.get("/metrics").status_code == 401
    response = http.get("/metrics", headers={"Authorization": "Bearer k"})
    assert response.status_code == 200 and "tpfuse_requests" in response.text
    assert http.get("/health").status_code == 200


def test_cors_headers_only_for_the_allowed_origins():
    http = _app(cors_allow_origins=["https://ok.example"])
    preflight = {"Origin": "https://ok.example", "Access-Control-Request-Method": "POST"}
    response = http.options("/v1/completions", headers=preflight)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "https://ok.example"
    other = http.get("/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    assert "access-control-allow-origin" not in _app().get("/health", headers=preflight).headers


def test_non_ascii_keys_and_headers_are_compared_as_bytes_never_a_500():
    ascii_key, utf8_key = _app(api_key="secret"), _app(api_key="s\u00e9cret")
    for header in (b"Bearer s\xe9cret", b"Bearer s\xc3\xa9cret", b"Bearer secret\xff"):
        assert ascii_key.get("/v1/models", headers={"Authorization": header}).status_code == 401
    assert ascii_key.get("/v1/models", headers={"Authorization": "Bearer secret"}).status_code == 200
    right = "Bearer s\u00e9cret".encode()  # the key's UTF-8 bytes, as a client sends them
    assert utf8_key.get("/v1/models", headers={"Authorization": right}).status_code == 200
    assert utf8_key.get("/metrics", headers={"Authorization": right}).status_code == 200
    assert utf8_key.get("/v1/models", headers={"Authorization": "Bearer x"}).status_code == 401
