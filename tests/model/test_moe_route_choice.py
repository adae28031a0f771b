"""The start-up choice between the one-launch router + top-k and the router linear + top-k
(model/moe_choice.py): recorded per token bucket, never above MAX_TOKENS, and the same on every rank."""

import torch

from tpfuse.kernels.moe_router import MAX_TOKENS, ROUTE_TILES
from tpfuse.model import moe_choice
from tpfuse.model.layers import ParallelContext
from tpfuse.model.moe import SparseMoeBlock


def _block():
    return SparseMoeBlock(16, 6, 2, 8, True, ParallelContext(0, 1, None), torch.float32)


def test_each_token_bucket_takes_the_measured_route(monkeypatch):
    block = _block()

    def times(_, tokens):  # the second tile fastest up to 4 tokens, then linear + top-k
        return {None: 2.0 if tokens <= 4 else 0.5, **{t: 1.0 + (t != ROUTE_TILES[1]) for t in ROUTE_TILES}}

    monkeypatch.setattr(moe_choice, "_time_route", times)
    tensors: dict = {}
    decisions = moe_choice._route_decisions(block, 16, set(), tensors)
    assert [(k[2], tile) for _, k, tile in decisions] == [
        (1, ROUTE_TILES[1]), (2, ROUTE_TILES[1]), (4, ROUTE_TILES[1]), (8, None), (16, None)
    ]  # fmt: skip
    moe_choice._apply(decisions, tensors, [])
    tokens = (1, 3, 4, 5, 16, MAX_TOKENS + 1)
    got = [moe_choice.route_tile(torch.empty(t, 16), block.gate.weight) for t in tokens]
    assert got == [ROUTE_TILES[1]] * 3 + [None] * 3


def test_a_tie_keeps_the_linear_and_topk_route(monkeypatch):
    block = _block()
    monkeypatch.setattr(moe_choice, "_time_route", lambda *a: {None: 1.0, **dict.fromkeys(ROUTE_TILES, 1.0)})
    assert moe_choice._route_decisions(block, 1, set(), {})[0][2] is None


def test_the_fused_route_gives_the_linear_and_topk_result():
    block = _block()
    torch.nn.init.normal_(block.gate.weight)
    x = torch.randn(5, 16)
    from tpfuse.kernels import moe_route, moe_topk

    got = moe_route(x, block.gate.weight, 2, True)
    want = moe_topk(block.gate(x), 2, True)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])


def _slot_tile_for(block, monkeypatch, buckets=(2, 4, 8, 16, 32, 64, 128)):
    from tpfuse.kernels import fused_moe_tiles

    w13 = block.experts.w13
    for bucket in buckets:
        key = (tuple(w13.shape), w13.dtype, w13.device, bucket)
        monkeypatch.setitem(fused_moe_tiles._CHOSEN_TILES, key, fused_moe_tiles.MoeTile(1, 16, 32, 1, 4))


def test_the_fused_entry_runs_only_where_the_experts_route_and_the_finalize_is_fused(monkeypatch):
    from tpfuse.kernels.moe_norm_router import MAX_TOKENS, NORM_ROUTER_TILES

    block = _block()
    assert moe_choice.norm_route_tile(torch.empty(1, 16), block) is None  # grouped tile: no routed slots
    _slot_tile_for(block, monkeypatch, buckets=(2, 4))
    assert moe_choice.norm_route_tile(torch.empty(1, 16), block) == NORM_ROUTER_TILES[0]
    assert moe_choice.norm_route_tile(torch.empty(3, 16), block) is None  # 6 slots: bucket 8 is grouped
    monkeypatch.setitem(moe_choice._FUSED_FINALIZE, (16, torch.float32, torch.device("cpu"), 2), False)
    assert moe_choice.norm_route_tile(torch.empty(1, 16), block) is None  # the plain finalize was faster
    _slot_tile_for(block, monkeypatch, buckets=(256,))
    assert moe_choice.norm_route_tile(torch.empty(MAX_TOKENS + 1, 16), block) is None


def test_each_token_bucket_takes_the_measured_entry(monkeypatch):
    from tpfuse.kernels.moe_norm_router import NORM_ROUTER_TILES

    block = _block()
    _slot_tile_for(block, monkeypatch)

    def times(block, tokens):  # the fused entry wins up to 4 tokens (its second tile), then plain
        return {
            None: 2.0 if tokens <= 4 else 0.5,
            **{t: 1.0 + (t != NORM_ROUTER_TILES[1]) for t in NORM_ROUTER_TILES},
        }

    monkeypatch.setattr(moe_choice, "_time_norm_route", times)
    decisions = moe_choice._norm_route_decisions(block, 16, set())
    assert [(key[3], entry) for key, entry in decisions] == [
        (1, NORM_ROUTER_TILES[1]), (2, NORM_ROUTER_TILES[1]), (4, NORM_ROUTER_TILES[1]), (8, None), (16, None)
    ]  # fmt: skip
    for key, entry in decisions:
        monkeypatch.setitem(moe_choice._NORM_ROUTES, key, entry)
    got = [moe_choice.norm_route_tile(torch.empty(t, 16), block) for t in (1, 3, 4, 5, 16)]
    assert got == [NORM_ROUTER_TILES[1]] * 3 + [None] * 2
    monkeypatch.setattr(
        moe_choice, "_time_norm_route", lambda *a: dict.fromkeys((None, *NORM_ROUTER_TILES), 1.0)
    )
    assert moe_choice._norm_route_decisions(block, 1, set())[0][1] is None  # a tie keeps the plain entry
    near = 1.0 - moe_choice.ENTRY_MARGIN / 2  # faster, but within the margin: noise, plain stays
    within = {None: 1.0, **dict.fromkeys(NORM_ROUTER_TILES, near)}
    monkeypatch.setattr(moe_choice, "_time_norm_route", lambda *a: within)
    assert moe_choice._norm_route_decisions(block, 1, set())[0][1] is None


def test_a_fused_entry_whose_output_is_off_the_plain_one_is_left_out(monkeypatch, caplog):
    """The start-up timing runs each entry through the block first: a tile whose result disagrees with
    the plain sequence (a miscompiled kernel, say) is never recorded, and says so."""
    from tpfuse import knobs
    from tpfuse.kernels.moe_norm_router import NORM_ROUTER_TILES
    from tpfuse.model import moe

    block = _block()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    _slot_tile_for(block, monkeypatch)
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")
    knobs.reload()
    real = moe.moe_norm_route

    def broken_second_tile(x, residual, norm_w, gate, eps, tile):
        normed, new_residual, logits = real(x, residual, norm_w, gate, eps, tile)
        return (normed * 3 if tile == NORM_ROUTER_TILES[1] else normed), new_residual, logits

    monkeypatch.setattr(moe, "moe_norm_route", broken_second_tile)
    monkeypatch.setattr(moe_choice, "graph_us", lambda calls, *a: 1.0 if calls[0]() else 0.0)
    times = moe_choice._time_norm_route(block, 2)
    assert set(times) == {None, *NORM_ROUTER_TILES} - {NORM_ROUTER_TILES[1]}
    assert "left out: its output is off" in caplog.text
    assert moe_choice._norm_route_key(block.gate.weight, 2) not in moe_choice._NORM_ROUTES  # restored
