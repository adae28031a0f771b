"""Run `tpfuse serve` as a subprocess: start it on a free port, wait until /health is 200, stop it.

For `tpfuse demo`, benchmarks and tests. The server gets its own session (process group), so
`stop()` can wait for the HTTP process and the engine process it spawned, and kill both if needed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from tpfuse.comm.spawn_ranks import free_port


class ServerSubprocess:
    """`python -m <module> <args> --port <free port>`; output goes to a log file (`output()`).

    Use as a context manager, or call `wait_healthy()` and `stop()` yourself.
    """

    def __init__(self, args: list[str], module: str = "tpfuse.server", start_timeout: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_timeout = start_timeout
        fd, self.log_path = tempfile.mkstemp(prefix="tpfuse-server-", suffix=".log")
        cmd = [sys.executable, "-m", module, *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=fd, stderr=subprocess.STDOUT, start_new_session=True)
        os.close(fd)

    def __enter__(self) -> ServerSubprocess:
        try:
            self.wait_healthy()
        except BaseException:
            self.stop(signal.SIGKILL, timeout=1)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self.remove_log()

    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def health_status(self) -> int | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError):
            return None

    def wait_healthy(self) -> None:
        """Returns once /health is 200; raises RuntimeError with the server's output if it exits
        or is not healthy within start_timeout."""
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}:\n{self.output()}")
            if self.health_status() == 200:
                return
            time.sleep(0.1)
        raise RuntimeError(f"the server was not healthy after {self.start_timeout} s:\n{self.output()}")

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def wait_group_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.group_alive():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Signals the server and waits for it and its children; kills the group if they linger.
        Returns the server's exit code, or None if it had to be killed. The log stays readable."""
        code = None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = self.proc.wait(timeout)
        if not self.wait_group_gone(timeout if code is not None else 0.5):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            code = None
        return code

    def remove_log(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)
