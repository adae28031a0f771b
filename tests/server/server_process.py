"""Start a server subprocess on a free port, wait (bounded) until /health is 200, always stop it.

The server runs in its own session, so stop() can check and clean up its whole process group:
the HTTP process and the engine process it spawned.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx
from tests.helpers.dist import free_port


class ServerProcess:
    def __init__(self, module: str, args: list[str], start_timeout: float = 180.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix="tpfuse-server-", suffix=".log")
        cmd = [sys.executable, "-m", module, *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True)
        os.close(fd)
        self.start_timeout = start_timeout

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server not healthy after {self.start_timeout} s:\n{self.output()}")

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def wait_group_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.group_alive():
                return True
            time.sleep(0.1)
        return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Signals the server, waits for it and its children; kills the group if they linger.
        Returns the server's exit code (None if it had to be killed)."""
        code = None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = self.proc.wait(timeout)
        if not self.wait_group_gone(timeout if code is not None else 0.5):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            code = None
        return code


def start_server(module: str, args: list[str], start_timeout: float = 180.0) -> ServerProcess:
    server = ServerProcess(module, args, start_timeout)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop(signal.SIGKILL, timeout=1)
        raise
    return server
