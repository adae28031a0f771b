"""The GPU build of the peer-memory kernels, checked on CPU: compile to PTX for an sm_90 target.

The interpreter never takes the inline-PTX branches, so this is where the real flag protocol is seen:
release stores and acquire loads at system scope, the global timer bounding the spin, and atomics only
at GPU scope (the local error word and program counter; no remote atomics).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ptx_by_kernel():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.comm.compile_ptx"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    "name",
    ["one_shot", "two_shot", "one_shot_fp8", "two_shot_fp8_rows", "one_shot_fp8_groups", "two_shot_half2x",
     "staged", "ordered_push", "hierarchical", "pull"],
)  # fmt: skip
def test_flags_are_release_stores_and_acquire_loads_at_system_scope(ptx_by_kernel, name):
    ptx = ptx_by_kernel[name]
    assert "st.release.sys.global.u32" in ptx
    assert "ld.acquire.sys.global.u32" in ptx


@pytest.mark.parametrize("name", ["one_shot", "two_shot", "staged", "ordered_push", "hierarchical", "pull"])
def test_spins_are_bounded_by_the_global_timer(ptx_by_kernel, name):
    assert "%globaltimer" in ptx_by_kernel[name]


@pytest.mark.parametrize("name", ["one_shot", "two_shot", "staged", "ordered_push", "hierarchical", "pull"])
def test_no_atomic_is_wider_than_gpu_scope(ptx_by_kernel, name):
    atomics = re.findall(r"\b(?:atom|red)\.[\w.:]+", ptx_by_kernel[name])
    assert atomics, "the local error word and program counter use atomics"
    assert all(".gpu." in a for a in atomics), atomics


def test_one_shot_moves_rows_in_16_byte_vectors(ptx_by_kernel):
    ptx = ptx_by_kernel["one_shot"]
    assert "st.global.v4" in ptx and "ld.volatile.global.v4" in ptx


def test_the_link_probe_times_release_stores_and_acquire_loads_at_system_scope(ptx_by_kernel):
    assert "st.release.sys.global.u32" in ptx_by_kernel["probe_write_latency"]
    assert "ld.acquire.sys.global.u32" in ptx_by_kernel["probe_read_latency"]
    assert all("%globaltimer" in ptx_by_kernel[k] for k in ("probe_write_latency", "probe_read_latency"))
