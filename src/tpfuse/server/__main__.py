"""`python -m tpfuse.server [serve flags]`: the same as `tpfuse serve`."""

import argparse
import sys

from tpfuse.server.cli import register

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m tpfuse.server")
    subparsers = parser.add_subparsers(dest="command")
    register(subparsers)
    args = parser.parse_args(["serve", *sys.argv[1:]])
    sys.exit(args.handler(args))
