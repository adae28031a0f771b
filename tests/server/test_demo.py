"""`tpfuse demo` serves the embedded model, shows requests and stops the server."""

import argparse

from tpfuse.demo import register


def _demo_args(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["demo", *argv])


def test_demo_prints_completion_chat_stream_and_burst_then_stops_the_server(capsys):
    args = _demo_args("--device", "cpu", "--max-tokens", "3")
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    for section in (
        "server ready at http://127.0.0.1:",
        "== completion ==",
        "== chat ==",
        "== streamed chat ==",
        "[usage] 3 tokens",
        "== 8 concurrent completions ==",
        "24 tokens in",
        "server stopped",
    ):
        assert section in out


def test_demo_refuses_a_non_positive_token_count(capsys):
    args = _demo_args("--max-tokens", "0")
    assert args.handler(args) == 2
    assert "--max-tokens must be >= 1" in capsys.readouterr().err
