"""`python -m tests.server.serve_fake [serve flags]`: tpfuse serve with the FakeEngine (or a failing one)."""

import argparse
import sys

from tests.server.fake_engine import make_failing_engine, make_fake_engine, make_slow_engine

from tpfuse.config import add_engine_args, add_server_args, engine_config_from_args, server_config_from_args
from tpfuse.server.cli import run_server

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    add_server_args(parser)
    parser.add_argument("--fail-at-start", action="store_true")
    parser.add_argument("--slow-start", action="store_true")
    args = parser.parse_args()
    factory = make_failing_engine if args.fail_at_start else make_fake_engine
    factory = make_slow_engine if args.slow_start else factory
    sys.exit(run_server(engine_config_from_args(args), server_config_from_args(args), factory))
