"""Driving a tensor-parallel engine in a child process, for the tests that kill one of its ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def start_engine_script(directory, script: str, *args: str) -> tuple[subprocess.Popen, list[int]]:
    """Runs `script` (which prints its worker pids on one line, then works) with python in a child
    process; returns the process and the worker pids."""
    path = directory / "tp_engine.py"
    path.write_text(script)
    proc = subprocess.Popen(
        [sys.executable, str(path), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()
    assert line.strip(), proc.stderr.read()
    return proc, [int(pid) for pid in line.split()]


def kill_worker_and_read_the_engine_error(proc: subprocess.Popen, worker: int, timeout: float = 30) -> str:
    """SIGKILLs one worker; the engine must exit non-zero within `timeout` s. Returns its stderr."""
    try:
        os.kill(worker, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    assert proc.returncode != 0
    return stderr
