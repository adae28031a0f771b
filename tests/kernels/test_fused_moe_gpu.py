"""Fused MoE on the GPU (bf16, qwen3-30b-a3b expert shapes) against float64, at decode and prefill
sizes, eagerly and replayed from a CUDA graph with fresh routing each replay."""

from __future__ import annotations

import pytest
import torch

from tpfuse.kernels import fused_experts, moe_topk
from tpfuse.kernels.fused_moe import fused_experts_ref, fused_experts_triton
from tpfuse.kernels.fused_moe_tiles import CANDIDATE_TILES, SLOT_DOWN_SHAPES, MoeTile
from tpfuse.kernels.moe_routing import moe_topk_ref

pytestmark = pytest.mark.gpu
CUDA = "cuda"
E, H, I, K = 128, 2048, 768, 8  # qwen3-30b-a3b: 128 experts of 768, top-8
TOLERANCE = 2e-2  # bf16 inputs and outputs, float32 accumulation


def experts(seed: int, num_experts: int = E, hidden: int = H, inter: int = I):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device=CUDA, generator=g) * 0.03).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, device=CUDA, generator=g) * 0.03).bfloat16()
    return w13, w2


def routed_inputs(num_tokens: int, seed: int, num_experts: int = E, hidden: int = H):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(num_tokens, hidden, device=CUDA, generator=g).bfloat16()
    logits = torch.randn(num_tokens, num_experts, device=CUDA, generator=g).bfloat16()
    return x, logits


def float64_reference(x, logits, w13, w2):
    weights, ids = moe_topk_ref(logits.double(), K, True)
    return fused_experts_ref(x.double(), w13.double(), w2.double(), weights, ids)


def relative_error(got, want) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("num_tokens", [1, 3, 8, 33, 64, 2048, 4099])
def test_fused_moe_matches_float64_at_decode_and_prefill_sizes(num_tokens):
    w13, w2 = experts(num_tokens)
    x, logits = routed_inputs(num_tokens, seed=num_tokens + 1)
    weights, ids = moe_topk(logits, K, True)
    assert torch.equal(ids, moe_topk_ref(logits, K, True)[1])
    got = fused_experts(x, w13, w2, weights, ids)
    assert relative_error(got, float64_reference(x, logits, w13, w2)) <= TOLERANCE


@pytest.mark.parametrize("tile", CANDIDATE_TILES, ids=lambda t: t.label())
def test_every_candidate_tile_matches_float64(tile):
    w13, w2 = experts(5)
    x, logits = routed_inputs(77, seed=6)
    weights, ids = moe_topk(logits, K, True)
    got = fused_experts_triton(x, w13, w2, weights, ids, tile=tile)
    assert relative_error(got, float64_reference(x, logits, w13, w2)) <= TOLERANCE


@pytest.mark.parametrize("shape", SLOT_DOWN_SHAPES, ids=lambda s: "{}x{} w{}".format(*s))
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_every_slot_down_shape_matches_float64(shape, num_tokens):
    w13, w2 = experts(7)
    x, logits = routed_inputs(num_tokens, seed=8)
    weights, ids = moe_topk(logits, K, True)
    got = fused_experts_triton(x, w13, w2, weights, ids, tile=MoeTile(1, 32, 256, 2, 4, down=shape))
    assert relative_error(got, float64_reference(x, logits, w13, w2)) <= TOLERANCE


@pytest.mark.parametrize("num_tokens", [1, 16, 64, 1024])
def test_fused_moe_replayed_from_a_cuda_graph_follows_new_routing(num_tokens):
    w13, w2 = experts(11)
    x, logits = routed_inputs(num_tokens, seed=12)
    static_x, static_logits = x.clone(), logits.clone()

    def layer():
        weights, ids = moe_topk(static_logits, K, True)
        return fused_experts(static_x, w13, w2, weights, ids)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    for seed in (13, 14, 15):
        x, logits = routed_inputs(num_tokens, seed=seed)
        if seed == 15:  # every token on the same eight experts
            logits = torch.zeros_like(logits)
            logits[:, 100:108] = 5.0
        static_x.copy_(x)
        static_logits.copy_(logits)
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, float64_reference(x, logits, w13, w2)) <= TOLERANCE


def test_qwen3_30b_a3b_preset_serves_end_to_end_with_cuda_graphs_deterministically():
    """Dummy weights make near-tied logits, so tokens are compared run against run, not with eager.
    The prefix cache is off: a cached prompt changes the first step's token count, hence its MoE tile
    and reduction order, which near-tied logits turn into other tokens."""
    from tpfuse import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300], list(range(500, 540))]
    llm = LLM(
        "qwen3-30b-a3b", dtype="bfloat16", max_model_len=512, mem_fraction_static=0.85, device="cuda",
        enable_prefix_caching=False,
    )  # fmt: skip
    assert llm.engine.executor.runner.graphs is not None
    first = [o.token_ids for o in llm.generate(prompts, params)]
    assert all(len(t) == 24 and max(t) < 151936 for t in first)
    assert [o.token_ids for o in llm.generate(prompts, params)] == first
    llm.shutdown()


@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
def test_moe_finalize_matches_float64_in_and_out_of_a_cuda_graph(num_tokens):
    from tpfuse.kernels import moe_finalize_op
    from tpfuse.kernels.moe_finalize import moe_finalize_ref

    g = torch.Generator(device=CUDA).manual_seed(num_tokens)
    slots = torch.randn(num_tokens * K, H, device=CUDA, generator=g).bfloat16()
    residual = torch.randn(num_tokens, H, device=CUDA, generator=g).bfloat16()
    weight = (torch.rand(H, device=CUDA, generator=g) + 0.5).bfloat16()
    want = moe_finalize_ref(slots.double(), K, residual.double(), weight.double(), 1e-6)
    normed, new_residual = moe_finalize_op(slots, K, residual, weight, 1e-6)
    assert relative_error(new_residual, want[1]) <= 1e-2 and relative_error(normed, want[0]) <= 2e-2
    moe_finalize_op(slots, K, residual, weight, 1e-6)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = moe_finalize_op(slots, K, residual, weight, 1e-6)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed[0], normed) and torch.equal(graphed[1], new_residual)
    # DeepSeek-V3's shared row, read where it lies: the same bits as one more slot per token
    shared = torch.randn(num_tokens, H, device=CUDA, generator=g).bfloat16()
    joined = torch.cat([slots.view(num_tokens, K, H), shared.view(num_tokens, 1, H)], 1).view(-1, H)
    got = moe_finalize_op(slots, K, residual, weight, 1e-6, shared)
    as_slot = moe_finalize_op(joined, K + 1, residual, weight, 1e-6)
    assert torch.equal(got[0], as_slot[0]) and torch.equal(got[1], as_slot[1])


def test_start_up_choice_keeps_the_fastest_measured_tile_and_records_it():
    from types import SimpleNamespace

    from tpfuse.kernels import fused_moe_tiles
    from tpfuse.model import moe_choice

    w13, w2 = experts(21)
    block = torch.nn.Module()
    block.top_k, block.experts = K, SimpleNamespace(w13=w13, w2=w2, hidden_size=H)
    decisions = moe_choice.choose(block, max_decode_rows=64, max_prefill_tokens=2048, tp_size=1)
    assert {d.slots_bucket for d in decisions} >= {8, 512, 16384}
    for d in decisions:
        assert d.us <= d.default_us
        assert fused_moe_tiles.tile_for(w13, d.slots_bucket) == d.tile
        decode = d.slots_bucket <= fused_moe_tiles.DECODE_MAX_SLOTS
        assert (d.tile in fused_moe_tiles.DECODE_TILES) == decode
    x = torch.empty(1, H, device=CUDA, dtype=torch.bfloat16)
    assert isinstance(moe_choice.fuse_finalize(x, K), bool)


@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_one_launch_router_matches_float64_and_replays_from_a_graph(num_tokens):
    from tpfuse.kernels.moe_router import ROUTE_TILES, moe_route_ref, moe_route_triton

    g = torch.Generator(device=CUDA).manual_seed(num_tokens)
    gate = (torch.randn(E, H, device=CUDA, generator=g) * 0.02).bfloat16()
    for _ in range(200):  # inputs with at least one row whose top k + 1 logits are clearly apart
        x = torch.randn(num_tokens, H, device=CUDA, generator=g).bfloat16()
        # rows whose k + 1 largest exact logits are more than 2 bf16 spacings apart: rounding the
        # float32 sums to bf16 cannot reorder them, so the ids must equal the float64 reference's
        top = (x.double() @ gate.double().T).sort(dim=1, descending=True).values[:, : K + 1]
        clear = ((top[:, :-1] - top[:, 1:]) > 2 * top[:, :-1].abs() * 2.0**-7).all(dim=1)
        if clear.any():
            break
    assert clear.any()
    want_w, want_ids = moe_route_ref(x.double(), gate.double(), K, True)
    for tile in ROUTE_TILES:
        weights, ids = moe_route_triton(x, gate, K, True, tile)
        assert torch.equal(ids[clear], want_ids[clear]), tile
        torch.testing.assert_close(weights[clear].double(), want_w[clear], rtol=2e-2, atol=1e-3)
        assert torch.equal(ids, moe_route_triton(x, gate, K, True, ROUTE_TILES[0])[1]), "tiles disagree"
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = moe_route_triton(static_x, gate, K, True)
    for seed in range(3):  # fresh inputs each replay: the arrival counters were reset by the last program
        static_x.copy_(torch.randn(num_tokens, H, device=CUDA, generator=g.manual_seed(seed)).bfloat16())
        graph.replay()
        eager = moe_route_triton(static_x, gate, K, True)
        assert torch.equal(graphed[1], eager[1]) and torch.equal(graphed[0], eager[0])


def test_start_up_choice_times_the_router_routes_per_token_bucket():
    from tpfuse.kernels.moe_router import ROUTE_TILES
    from tpfuse.model import moe_choice
    from tpfuse.model.layers import ParallelContext
    from tpfuse.model.moe import SparseMoeBlock

    block = SparseMoeBlock(H, E, K, I, True, ParallelContext(0, 1, None), torch.bfloat16).to(CUDA)
    torch.nn.init.normal_(block.gate.weight, std=0.02)
    moe_choice.choose(block, max_decode_rows=16, max_prefill_tokens=16, tp_size=1)
    for tokens in (1, 2, 4, 8, 16):
        x = torch.empty(tokens, H, device=CUDA, dtype=torch.bfloat16)
        assert moe_choice.route_tile(x, block.gate.weight) in (None, *ROUTE_TILES)
    too_many = torch.empty(65, H, device=CUDA, dtype=torch.bfloat16)
    assert moe_choice.route_tile(too_many, block.gate.weight) is None


@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_fused_moe_entry_matches_float64_and_replays_from_a_graph(num_tokens):
    """add + RMSNorm + router in one launch, the top-k inside the per-slot gate/up launch: against
    float64 on rows whose routing rounding cannot reorder; against the unfused kernels the new
    residual bit for bit, the normed row within one bf16 ulp and the routing weights within float32
    rounding (each launch shape sums in its own order: an H100 run found both off by ulps), the ids
    equal; replayed from a CUDA graph on fresh inputs."""
    from tpfuse.kernels.fused_moe import expert_slot_outputs, routed_slot_outputs_triton
    from tpfuse.kernels.moe_finalize import moe_finalize_ref
    from tpfuse.kernels.moe_norm_router import NORM_ROUTER_TILES, moe_norm_router_ref, moe_norm_router_triton
    from tpfuse.kernels.moe_routing import moe_topk_triton
    from tpfuse.kernels.rmsnorm import fused_add_rmsnorm_triton

    w13, w2 = experts(num_tokens + 40)
    g = torch.Generator(device=CUDA).manual_seed(num_tokens)
    gate = (torch.randn(E, H, device=CUDA, generator=g) * 0.05).bfloat16()
    norm_weight = (torch.rand(H, device=CUDA, generator=g) + 0.5).bfloat16()
    x, residual = (torch.randn(num_tokens, H, device=CUDA, generator=g).bfloat16() for _ in range(2))
    want_normed, want_res, want_logits = moe_norm_router_ref(
        *(t.double() for t in (x, residual, norm_weight, gate)), 1e-6
    )
    plain = fused_add_rmsnorm_triton(x, residual, norm_weight, 1e-6)
    for tile in NORM_ROUTER_TILES:
        normed, new_res, logits = moe_norm_router_triton(x, residual, norm_weight, gate, 1e-6, tile)
        assert torch.equal(new_res, plain[1]), tile
        ulp = plain[0].float().abs() * 2.0**-7  # one bf16 ulp (or less) of the unfused normed row
        assert ((normed.float() - plain[0].float()).abs() <= ulp).all(), tile
        assert relative_error(logits, want_logits) <= TOLERANCE, tile
    tile = MoeTile(1, 32, 256, 2, 4)
    slots, weights, ids = routed_slot_outputs_triton(normed, w13, w2, logits, K, True, tile)
    want_w, want_ids = moe_topk_triton(logits, K, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=2e-6, atol=0)
    assert torch.equal(slots, expert_slot_outputs(normed, w13, w2, weights, ids, tile))
    f64_slots = fused_experts_ref(
        normed.double(), w13.double(), w2.double(), want_w.double(), want_ids, combine=False
    )
    assert relative_error(slots, f64_slots.flatten(0, 1)) <= TOLERANCE
    assert relative_error(normed, want_normed) <= TOLERANCE and relative_error(new_res, want_res) <= TOLERANCE
    static = (x.clone(), residual.clone())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_normed, g_res, g_logits = moe_norm_router_triton(*static, norm_weight, gate, 1e-6)
        g_slots, g_w, g_ids = routed_slot_outputs_triton(g_normed, w13, w2, g_logits, K, True, tile)
    for seed in range(3):
        torch.manual_seed(seed)
        for t in static:
            t.copy_(torch.randn_like(t))
        graph.replay()
        e_normed, e_res, e_logits = moe_norm_router_triton(*static, norm_weight, gate, 1e-6)
        e_slots, e_w, e_ids = routed_slot_outputs_triton(e_normed, w13, w2, e_logits, K, True, tile)
        assert torch.equal(g_ids, e_ids) and torch.equal(g_w, e_w) and torch.equal(g_slots, e_slots)
        assert torch.equal(g_res, e_res) and torch.equal(g_normed, e_normed)
    finalized = moe_finalize_ref(g_slots.double(), K, g_res.double(), norm_weight.double(), 1e-6)
    assert finalized[0].isfinite().all()


def test_start_up_choice_times_the_fused_moe_entry():
    from tpfuse.comm.communicator import SingleRankCommunicator
    from tpfuse.kernels.moe_norm_router import NORM_ROUTER_TILES
    from tpfuse.model import moe_choice
    from tpfuse.model.layers import ParallelContext
    from tpfuse.model.moe import SparseMoeBlock

    block = SparseMoeBlock(H, E, K, I, True, ParallelContext(0, 1, None), torch.bfloat16).to(CUDA)
    for p in (block.gate.weight, block.experts.w13, block.experts.w2):
        torch.nn.init.normal_(p, std=0.02)
    moe_choice.choose(block, max_decode_rows=8, max_prefill_tokens=8, tp_size=1)
    entries = [moe_choice.norm_route_tile(torch.empty(t, H, device=CUDA, dtype=torch.bfloat16), block)
               for t in (1, 2, 4, 8)]  # fmt: skip
    assert all(e in (None, *NORM_ROUTER_TILES) for e in entries)
    x, residual = (torch.randn(4, H, device=CUDA).bfloat16() for _ in range(2))
    w = torch.ones(H, device=CUDA, dtype=torch.bfloat16)
    comm = SingleRankCommunicator()
    got = block.forward_after_attention(x, residual, w, w, 1e-6, comm)
    h, res = comm.fused_add_rmsnorm_all_reduce(x, residual, w, 1e-6)
    want = block.forward_add_rmsnorm(h, res, w, 1e-6, comm)
    assert relative_error(got[0], want[0].double()) <= TOLERANCE and torch.equal(got[1], want[1])
