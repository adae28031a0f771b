"""Programmatic dependent launch (kernels/pdl.py): off where it cannot run, and on a GPU a chain of PDL
kernels inside a CUDA graph gives the bits of the same chain launched plainly."""

import pytest
import torch

from tests.helpers.quant_experts import random_expert_stack
from tpfuse import knobs
from tpfuse.kernels import gemv, pdl, rmsnorm


def test_off_on_the_cpu_and_until_chosen():
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


def _with_and_without_pdl(run):
    """run's outputs from a CUDA graph with PDL on (where the probe passes) and off, asserted equal bit
    for bit; returns the plain ones."""
    device = torch.device("cuda")
    pdl.choose(device, True)
    try:
        used = pdl.enabled(device)
        with_pdl = _graph_run(run)
    finally:
        pdl.choose(device, False)
    plain = _graph_run(run)
    for a, b in zip(with_pdl, plain, strict=True):
        assert torch.equal(a, b), f"PDL {'on' if used else 'off (probe failed)'}: results differ"
    return plain


def test_choose_turns_it_off_and_tp_runs_plain():
    from tpfuse.engine.launch_choice import choose_pdl

    device = torch.device("cuda", 0)  # no CUDA call is made: unsupported here, so nothing is timed
    assert choose_pdl(None, device, tp_size=1) is None
    assert choose_pdl(None, device, tp_size=2) is None
    assert not pdl.enabled(device)
    pdl.choose(device, True)
    try:
        assert pdl.enabled(device) == pdl.supported(device)
    finally:
        pdl.choose(device, False)


@pytest.mark.gpu
def test_a_pdl_chain_in_a_cuda_graph_equals_the_plain_chain():
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(0)
    hidden = 1000  # odd: masked steps
    ws = [torch.randn(hidden, hidden, generator=gen, device=device).bfloat16() * 0.05 for _ in range(12)]
    norm_w = torch.rand(hidden, generator=gen, device=device).bfloat16() + 0.5
    x0 = torch.randn(1, hidden, generator=gen, device=device).bfloat16()
    res0 = torch.randn(1, hidden, generator=gen, device=device).bfloat16()
    _with_and_without_pdl(lambda: _chain(ws, norm_w, x0, res0))
    assert pdl.launch(device) == {"PDL": False}
    ref_h, _ = _chain(ws, norm_w, x0, res0)
    assert torch.isfinite(ref_h.float()).all()


def _quantized_chain(ws, scales, block, gate, norm_w, x0, res0):
    """GEMV of e4m3 weights -> fused add + RMSNorm -> the one-launch MoE router, per layer: each
    kernel reads what the one before it wrote, and the GEMV and the router load weights before
    their PDL wait."""
    from tpfuse.kernels.moe_router import ROUTE_TILES, moe_route_triton
    from tpfuse.kernels.quant_fp8 import fp8_linear_triton

    h, res, routes = x0, res0, []
    for w, s in zip(ws, scales, strict=True):
        partial = fp8_linear_triton(h, w, s, block)
        h, res = rmsnorm.fused_add_rmsnorm_triton(partial, res, norm_w, 1e-6)
        routes += moe_route_triton(h, gate, 4, True, ROUTE_TILES[1])
    return h, res, *routes


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(1, 1000), (128, 128)], ids=["per-channel", "blocks"])
def test_pdl_fp8_gemv_and_router_chain_in_a_cuda_graph_equals_the_plain_chain(block):
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(1)
    hidden = 1000  # odd: masked steps
    ws = [(torch.randn(hidden, hidden, generator=gen, device=device) * 0.5).to(torch.float8_e4m3fn)
          for _ in range(8)]  # fmt: skip
    grid = (-(-hidden // block[0]), -(-hidden // block[1]))
    scales = [torch.rand(grid, generator=gen, device=device) * 0.05 + 0.01 for _ in ws]
    gate = torch.randn(60, hidden, generator=gen, device=device).bfloat16()
    norm_w = torch.rand(hidden, generator=gen, device=device).bfloat16() + 0.5
    x0 = torch.randn(1, hidden, generator=gen, device=device).bfloat16()
    res0 = torch.randn(1, hidden, generator=gen, device=device).bfloat16()
    _with_and_without_pdl(lambda: _quantized_chain(ws, scales, block, gate, norm_w, x0, res0))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(4, 2048, 1), (4, 128, 1)], ids=["one-step", "steps"])
def test_pdl_half2_int4_chain_in_a_cuda_graph_equals_the_plain_chain(tile):
    """The f16x2 INT4 GEMV (kernels/quant_int_half2.py) in a PDL chain: GEMV -> fused add + RMSNorm per
    layer, with PDL and without, bit for bit (one K step and several, masked)."""
    from tpfuse.kernels import quant_int
    from tpfuse.kernels.quant_int_half2 import Half2Tile

    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(2)
    hidden, group = 1056, 96  # 33 vectors: masked steps at 128
    ws = [quant_int.pack_int(torch.randint(0, 16, (hidden, hidden), generator=gen, device=device), 4)
          for _ in range(8)]  # fmt: skip
    scales = [(torch.rand(hidden, hidden // group, generator=gen, device=device) * 0.02 + 0.005).bfloat16()
              for _ in ws]  # fmt: skip
    norm_w = torch.rand(hidden, generator=gen, device=device).bfloat16() + 0.5
    x0 = torch.randn(1, hidden, generator=gen, device=device).bfloat16()
    res0 = torch.randn(1, hidden, generator=gen, device=device).bfloat16()
    half2 = Half2Tile(1, tile[0], tile[1], 1, tile[2])

    def run():
        h, res = x0, res0
        for w, s in zip(ws, scales, strict=True):
            partial = quant_int.int_linear_triton(h, w, s, None, 4, group, tile=half2)
            h, res = rmsnorm.fused_add_rmsnorm_triton(partial, res, norm_w, 1e-6)
        return h, res

    plain = _with_and_without_pdl(run)
    assert torch.isfinite(plain[0].float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["int4-w8a16", "int4-half2", "fp8-w8a16", "fp8-w8a8"])
def test_pdl_quantized_moe_chain_in_a_cuda_graph_equals_the_plain_chain(route):
    """A MoE layer's decode chain per layer (add + RMSNorm + router, the quantized expert slots, the MoE
    finalize) with PDL and without, bit for bit: the slot kernels wait before reading the routing."""
    from tpfuse.kernels import quant_fp8_w8a8, quant_moe, quant_moe_w8a8
    from tpfuse.kernels.moe_finalize import moe_finalize_triton
    from tpfuse.kernels.moe_norm_router import moe_norm_router_triton
    from tpfuse.kernels.moe_routing import moe_topk_triton

    device = torch.device("cuda")
    assert route != "fp8-w8a8" or quant_fp8_w8a8.fp8_dot_supported(device), "the GPU suite runs on Hopper"
    gen = torch.Generator(device).manual_seed(3)
    experts, hidden, inter, top_k, tokens = 32, 1024, 384, 4, 2
    bits = 4 if route.startswith("int4") else 0
    w13 = random_expert_stack(gen, bits, experts, 2 * inter, hidden, group=128)
    w2 = random_expert_stack(gen, bits, experts, hidden, inter, group=128)
    gate = (torch.randn(experts, hidden, generator=gen, device=device) * 0.05).bfloat16()
    norm_w = torch.rand(hidden, generator=gen, device=device).bfloat16() + 0.5
    x0 = torch.randn(tokens, hidden, generator=gen, device=device).bfloat16()
    res0 = torch.randn(tokens, hidden, generator=gen, device=device).bfloat16()

    def slots(h, logits):
        if route == "fp8-w8a8":
            weights, ids = moe_topk_triton(logits, top_k, True)
            return quant_moe_w8a8.w8a8_slots_triton(h, w13, w2, weights, ids, quant_moe_w8a8.SLOT_TILES[0])
        tile = quant_moe.HALF2_SLOT_TILES[0] if route == "int4-half2" else None
        return quant_moe.quant_routed_slots_triton(h, w13, w2, logits, top_k, True, tile=tile)[0]

    def run():
        partial, res = x0, res0
        for _ in range(4):
            h, res, logits = moe_norm_router_triton(partial, res, norm_w, gate, 1e-6)
            out, res = moe_finalize_triton(slots(h, logits), top_k, res, norm_w, 1e-6)
            partial = out * 0.5
        return out, res

    plain = _with_and_without_pdl(run)
    assert torch.isfinite(plain[0].float()).all()
