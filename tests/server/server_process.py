"""Test-side use of tpfuse.server.launcher: a server subprocess that is always cleaned up."""

from __future__ import annotations

import signal

from tpfuse.server.launcher import ServerSubprocess


def start_server(module: str, args: list[str], start_timeout: float = 180.0) -> ServerSubprocess:
    """A healthy server (bounded wait); on failure it is killed and the test fails with its output."""
    server = ServerSubprocess(args, module=module, start_timeout=start_timeout)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop(signal.SIGKILL, timeout=1)
        raise
    return server
