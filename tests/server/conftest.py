import pytest
from tests.server.server_process import start_server

API_KEY = "sekret"


@pytest.fixture(scope="session")
def tiny_server():
    """`tpfuse serve --device cpu --model tiny` (the embedded default) on a free port, shared by
    every server test module: it must keep serving after whatever they send."""
    server = start_server("tpfuse", ["serve", "--device", "cpu", "--model", "tiny"])
    yield server
    server.stop()
    server.remove_log()


@pytest.fixture(scope="session")
def fake_server():
    """The server over tests/server/fake_engine.py (letters as tokens), with an API key."""
    server = start_server("tests.server.serve_fake", ["--device", "cpu", "--api-key", API_KEY])
    yield server
    server.stop()
    server.remove_log()
