"""TPFUSE_* knobs are read from the environment in tpfuse/knobs.py only, and never per op."""

import os
import pathlib
import re

import torch

from tpfuse import kernels, knobs

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "tpfuse"


def test_only_knobs_py_reads_tpfuse_variables():
    reads = re.compile(r"(os\.environ|getenv)[^\n]*TPFUSE_|TPFUSE_\w+[\"']\s*\)?\s*(in os\.environ)")
    found = [
        f"{path.relative_to(SRC)}:{n}"
        for path in SRC.rglob("*.py")
        if path.name != "knobs.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if reads.search(line)
    ]
    assert not found, f"read TPFUSE_* through tpfuse.knobs: {found}"


class _NoEnvironment(dict):
    def __getitem__(self, key):
        raise AssertionError(f"os.environ[{key!r}] read on the hot path")

    def get(self, key, default=None):
        raise AssertionError(f"os.environ.get({key!r}) read on the hot path")


def test_kernel_dispatch_does_not_read_the_environment(monkeypatch):
    x, w = torch.randn(3, 8), torch.ones(8)
    monkeypatch.setattr(os, "environ", _NoEnvironment())
    out = kernels.rmsnorm_op(x, w, 1e-6)
    assert torch.allclose(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_reload_picks_up_a_changed_variable(monkeypatch):
    monkeypatch.setenv(knobs.KERNELS, "torch")
    assert knobs.reload().kernels == "torch"
    assert not kernels.use_triton(torch.zeros(1))
    monkeypatch.setenv(knobs.KERNELS, "triton")
    knobs.reload()
    assert kernels.use_triton(torch.zeros(1))
