import pytest


@pytest.fixture
def fake_server():
    """A running fake OpenAI-compatible server; tests may change `server.behavior` before use."""
    from tests.bench.fake_server import FakeBehavior, FakeServer  # fastapi only where it is used

    with FakeServer(FakeBehavior()) as server:
        yield server


class WordTokenizer:
    """Client tokenizer for the fake server's text: one token per whitespace-separated word."""

    vocab_size = 1000

    def encode(self, text: str) -> list[int]:
        return [hash(w) % self.vocab_size for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


@pytest.fixture
def word_tokenizer():
    return WordTokenizer()
