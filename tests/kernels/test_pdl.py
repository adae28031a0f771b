"""Programmatic dependent launch (kernels/pdl.py): off where it cannot run, and on a GPU a chain of PDL
kernels inside a CUDA graph gives the bits of the same chain launched plainly."""

import pytest
import torch

from tpfuse import knobs
from tpfuse.kernels import gemv, pdl, rmsnorm


def test_off_on_the_cpu_and_the_launch_says_so():
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch(torch.device("cpu")) == {"PDL": False}


def test_the_knob_turns_it_off(monkeypatch):
    monkeypatch.setenv(knobs.PDL, "0")
    knobs.reload()
    try:
        assert not knobs.current.pdl
        assert not pdl.enabled(torch.device("cuda", 0))
    finally:
        monkeypatch.delenv(knobs.PDL)
        knobs.reload()
    assert knobs.current.pdl


def _chain(ws, norm_w, x0, res0):
    """A decode-like chain: GEMV -> fused add + RMSNorm -> GEMV ... (square weights)."""
    h, res = x0, res0
    for w in ws:
        partial = gemv.gemv_triton(h, w)
        h, res = rmsnorm.fused_add_rmsnorm_triton(partial, res, norm_w, 1e-6)
    return h, res


def _graph_run(fn):
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return [t.clone() for t in out]


@pytest.mark.gpu
def test_a_pdl_chain_in_a_cuda_graph_equals_the_plain_chain(monkeypatch):
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    hidden = 1000  # odd: masked steps
    ws = [torch.randn(hidden, hidden, generator=gen, device=device).bfloat16() * 0.05 for _ in range(12)]
    norm_w = torch.rand(hidden, generator=gen, device=device).bfloat16() + 0.5
    x0 = torch.randn(1, hidden, generator=gen, device=device).bfloat16()
    res0 = torch.randn(1, hidden, generator=gen, device=device).bfloat16()
    with_pdl = _graph_run(lambda: _chain(ws, norm_w, x0, res0))
    used = pdl.enabled(device)
    monkeypatch.setenv(knobs.PDL, "0")
    knobs.reload()
    try:
        plain = _graph_run(lambda: _chain(ws, norm_w, x0, res0))
    finally:
        monkeypatch.delenv(knobs.PDL)
        knobs.reload()
    for a, b in zip(with_pdl, plain):
        assert torch.equal(a, b), f"PDL {'on' if used else 'off (probe failed)'}: results differ"
    ref_h, _ = _chain(ws, norm_w, x0, res0)
    assert torch.isfinite(ref_h.float()).all()
