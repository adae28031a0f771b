"""`python -m tests.bench.cli_entry bench ...`: the bench subcommands alone, as `tpfuse` registers them."""

import argparse
import sys

from tpfuse.bench.cli import register


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tpfuse")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
