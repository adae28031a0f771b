"""A grammar that compiles slowly never stalls the engine loop: its request waits while a worker
thread compiles, the other requests run meanwhile, and a compile past the timeout fails only its
own request, with a 400-style rejection naming the grammar."""

import json
import multiprocessing
import threading
import time

import pytest
from tests.server.fake_engine import FakeEngine

from tpfuse.engine import grammar_compiler
from tpfuse.engine.grammar_compiler import GrammarCompiler, GrammarError, clean_message
from tpfuse.engine.sampling_params import Grammar, SamplingParams
from tpfuse.server import engine_process, grammar_admission

SLOW = Grammar("json_schema", json.dumps({"type": "string", "pattern": "[a-z]{1,50000}"}))
FAST = Grammar("json_schema", json.dumps({"type": "integer"}))
BAD = Grammar("json_schema", json.dumps({"type": "integer", "minimum": 5, "maximum": 1}))


class _XgrammarStandIn:
    """compile_json_schema: SLOW blocks until `release` is set; BAD raises xgrammar's kind of error."""

    def __init__(self):
        self.release = threading.Event()
        self.calls: list[str] = []

    def compile_json_schema(self, spec, any_whitespace):
        self.calls.append(spec)
        if spec == SLOW.spec:
            assert self.release.wait(30)
        if spec == BAD.spec:
            where = "[02:35:33] /project/cpp/json_schema_converter.cc:5082: "
            raise RuntimeError(where + "Invalid range: minimum greater than maximum\n")
        return ("compiled", spec)


class _Processing:
    def __init__(self, xgrammar):
        self.grammars = GrammarCompiler(lambda: xgrammar)


def _params(grammar=None, max_tokens=3) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, grammar=grammar)


@pytest.fixture
def loop():
    """The engine loop over a FakeEngine (with a grammar compiler) in a thread; yields (conn, xgrammar)."""
    xgrammar = _XgrammarStandIn()
    engine = FakeEngine(config=None, step_delay_s=0.01)
    engine.logits_processing = _Processing(xgrammar)
    ours, theirs = multiprocessing.Pipe()
    thread = threading.Thread(target=engine_process._serve, args=(theirs, engine), daemon=True)
    thread.start()
    yield ours, xgrammar
    xgrammar.release.set()
    ours.send(("shutdown",))
    thread.join(10)
    assert not thread.is_alive()


def _until(conn, want, timeout=20.0) -> list:
    """Messages (stats dropped) until want(message) holds for one; returns them all."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if conn.poll(0.05):
            message = conn.recv()
            if message[0] != "stats":
                seen.append(message)
                if want(message):
                    return seen
    raise AssertionError(f"timed out; saw {seen}")


def _finished(request_id):
    return lambda m: m[0] == "outputs" and any(o.request_id == request_id and o.finished for o in m[1])


def test_other_requests_run_while_a_grammar_compiles_and_it_is_served_after(loop):
    conn, xgrammar = loop
    conn.send(("add", "slow", [104, 105], _params(SLOW)))
    conn.send(("add", "plain", [104, 105], _params()))
    seen = _until(conn, _finished("plain"))
    assert not any(m[0] == "outputs" and any(o.request_id == "slow" for o in m[1]) for m in seen)
    xgrammar.release.set()
    _until(conn, _finished("slow"))
    conn.send(("add", "again", [104], _params(SLOW)))  # cached now: admitted without a compile
    _until(conn, _finished("again"))
    assert xgrammar.calls.count(SLOW.spec) == 1


def test_a_grammar_that_does_not_compile_is_rejected_without_xgrammars_source_paths(loop):
    conn, _ = loop
    conn.send(("add", "bad", [104], _params(BAD)))
    conn.send(("add", "fine", [104], _params(FAST)))
    seen = _until(conn, _finished("fine"))
    rejected = [m for m in seen if m[0] == "rejected"]
    assert len(rejected) == 1 and rejected[0][1] == "bad" and rejected[0][3] == "grammar"
    assert rejected[0][2] == (
        "the json_schema grammar does not compile: Invalid range: minimum greater than maximum"
    )


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setattr(grammar_admission, "COMPILE_TIMEOUT_S", 0.3)


def test_a_compile_past_the_timeout_fails_its_request_alone(short_timeout, loop):
    conn, _ = loop
    conn.send(("add", "slow", [104], _params(SLOW)))
    conn.send(("add", "plain", [104], _params(max_tokens=60)))
    seen = _until(conn, lambda m: m[0] == "rejected")
    assert seen[-1][1] == "slow" and seen[-1][3] == "grammar"
    assert "did not compile within 0.3 s" in seen[-1][2]
    _until(conn, _finished("plain"))


def test_an_abort_while_the_grammar_compiles_drops_the_request(loop):
    conn, xgrammar = loop
    conn.send(("add", "slow", [104], _params(SLOW)))
    conn.send(("abort", "slow"))
    conn.send(("add", "plain", [104], _params()))
    _until(conn, _finished("plain"))
    xgrammar.release.set()
    conn.send(("add", "after", [104], _params()))
    seen = _until(conn, _finished("after"))
    assert not any(m[0] == "outputs" and any(o.request_id == "slow" for o in m[1]) for m in seen)


def test_the_compiler_shares_one_compile_between_requests_of_one_grammar():
    xgrammar = _XgrammarStandIn()
    compiler = GrammarCompiler(lambda: xgrammar)
    first, second = compiler.submit(SLOW), compiler.submit(SLOW)
    assert first is second
    xgrammar.release.set()
    assert first.result(10) == ("compiled", SLOW.spec) and compiler.cached(SLOW) == first.result()
    assert xgrammar.calls == [SLOW.spec]
    with pytest.raises(GrammarError, match="minimum greater than maximum"):
        compiler.compile(BAD)


def test_xgrammar_messages_lose_source_locations_and_check_expressions():
    assert clean_message("[12:00:01] /a/b/x.cc:12: Invalid range\n") == "Invalid range"
    assert clean_message("[12:00:01] /a/x.cc:3: Check failed: (v <= m) is false: too big") == "too big"


def test_a_real_slow_schema_compiles_off_the_calling_thread():
    """xgrammar compiles without holding the GIL: the calling thread keeps running meanwhile."""
    xgrammar = pytest.importorskip("xgrammar")
    vocab = [chr(i) for i in range(32, 127)] + ["<eos>"]
    info = xgrammar.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
    compiler = GrammarCompiler(lambda: xgrammar.GrammarCompiler(info))
    schema = {"type": "string", "pattern": "[a-z]{1,3000}"}
    future = compiler.submit(Grammar("json_schema", json.dumps(schema)))
    ticks, longest, last = 0, 0.0, time.perf_counter()
    while not future.done():
        time.sleep(0.001)
        now = time.perf_counter()
        ticks, longest, last = ticks + 1, max(longest, now - last), now
    future.result()
    assert ticks > 10 and longest < 0.2, (ticks, longest)
    assert grammar_compiler.WORKERS >= 1
