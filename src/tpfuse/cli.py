"""`tpfuse` command line: one subcommand per job, each registered by the module that owns it.

Every `register(subparsers)` adds its parser with argparse only and sets `handler`, a function of the
parsed namespace returning an exit code; heavy imports (torch, triton, fastapi) happen inside the
handlers, so `tpfuse --help` and `tpfuse bench` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# module -> the subcommands it registers
SUBCOMMAND_MODULES = (
    "tpfuse.engine.cli",  # generate
    "tpfuse.server.cli",  # serve
    "tpfuse.bench.cli",  # bench single | sweep | compare
    "tpfuse.comm.cli",  # doctor, comm-bench
    "tpfuse.demo",  # demo
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpfuse", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
