"""Which fused-MoE tile runs each expert weight shape, measured per slot-count bucket at start-up.

The grouped GEMMs of kernels/fused_moe.py take a MoeTile (rows of one expert per program, output and
reduction columns, stages, warps). At decode the product streams each routed expert's weights for a few
rows; at prefill it is a tensor-core GEMM per expert; which tile is fastest depends on the shape, the
routing spread and the GPU, so it is timed, never assumed: for each distinct (w13, w2) shape of a
model's FusedMoE layers and each power-of-two bucket of T * k slots up to the engine's largest step,
every candidate (DECODE_TILES up to DECODE_MAX_SLOTS slots, PREFILL_TILES above) is timed by CUDA-graph
replay on uniformly random routing over the model's own weights, and the fastest is recorded with
fused_moe_tiles.set_tile; where that is a per-slot GEMV tile, the down product alone is timed at
SLOT_DOWN_SHAPES too and takes its own fastest shape. At TP = 1 it also times, per hidden size and
bucket, the MoE finalize (combine + residual + RMSNorm in one kernel) against the plain combine kernel
followed by fused_add_rmsnorm, and SparseMoeBlock takes the faster (fuse_finalize). Per router shape and
token bucket up to moe_router.MAX_TOKENS it times the one-launch router + top-k (kernels/moe_router.py
for softmax routers, kernels/moe_grouped_router.py for DeepSeek-V3's grouped ones; each of
ROUTE_TILES) against the router linear followed by the top-k kernel (route_tile). For
quantized experts it times each slot route their method offers at every slot bucket (per slot W8A16, per
slot W8A8 for FP8 formats that quantize activations, grouped GEMM tiles) and records the fastest
(model/quant/experts.set_slot_route). At TP = 1, once those are recorded, it times each SparseMoeBlock's
fused entry (the post-attention add + RMSNorm inside the router product, the top-k inside the per-slot
experts: kernels/moe_norm_router.py) against the plain sequence per token bucket, through the block
itself (norm_route_tile). At TP > 1 every rank applies rank 0's decisions (`agree`): the
routing must be bit-identical on every rank, or ranks would run different experts for the same token. On
CPU nothing is timed: the default tiles run, the fused finalize and the fused route (and the fused
entry wherever a per-slot tile is recorded).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch
from torch import nn
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from tpfuse.comm.communicator import SingleRankCommunicator
from tpfuse.gpu_timing import graph_us
from tpfuse.kernels import fused_moe, moe_norm_router, moe_router
from tpfuse.kernels import fused_moe_tiles as tiles
from tpfuse.kernels.fused_moe_gemv import slot_down
from tpfuse.kernels.fused_moe_tiles import MoeTile
from tpfuse.kernels.moe_finalize import moe_finalize_triton
from tpfuse.kernels.moe_norm_router import NormRouterTile
from tpfuse.kernels.moe_router import RouteTile
from tpfuse.kernels.rmsnorm import fused_add_rmsnorm_triton
from tpfuse.model.linear_choice import AGREEMENT
from tpfuse.model.quant.experts import set_slot_route

log = logging.getLogger("tpfuse")

# The fused entry must beat the plain one by this fraction: its normed row and routing weights differ
# from the unfused kernels' by ulps, and on an H100 it timed 37.0 us against plain's 37.2 (noise).
ENTRY_MARGIN = 0.02
_FUSED_FINALIZE: dict[tuple, bool] = {}  # (hidden, dtype, device, slots bucket) -> fused is faster
# (gate shape, dtype, device, tokens bucket) -> the norm + router tile, None where the plain entry is faster
_NORM_ROUTES: dict[tuple, NormRouterTile | None] = {}
# (gate shape, dtype, device, tokens bucket) -> the one-launch tile, None where linear + top-k is faster
_ROUTE_TILES: dict[tuple, RouteTile | None] = {}


def route_tile(x: torch.Tensor, gate: torch.Tensor) -> RouteTile | None:
    """The launch shape of the one-launch router for x [T, H] and weight gate [E, H], or None for the
    router linear + top-k: None above moe_router.MAX_TOKENS tokens; measured at start-up; the default
    tile where nothing was measured."""
    if x.shape[0] > moe_router.MAX_TOKENS:
        return None
    key = (tuple(gate.shape), gate.dtype, gate.device, tiles.slots_bucket(x.shape[0]))
    return _ROUTE_TILES.get(key, moe_router.ROUTE_TILES[0])


def _time_route(block, num_tokens: int) -> dict:
    """us of block's routing at num_tokens tokens per route: each RouteTile, and None (linear + top-k)."""
    gate = block.router_weight
    x = torch.randn(num_tokens, gate.shape[1], device=gate.device).to(block.experts.dtype)
    return {
        tile: graph_us([lambda t=tile: block.route_with(x, t)], 16, 5, 3)
        for tile in (None, *moe_router.ROUTE_TILES)
    }


def norm_route_tile(x: torch.Tensor, block) -> NormRouterTile | None:
    """The launch shape of the norm + router kernel when SparseMoeBlock block takes its fused entry for
    the attention's partial sum x [T, H] (kernels/moe_norm_router.py, then the top-k inside the
    experts' first kernel), or None for the plain sequence: None above moe_norm_router.MAX_TOKENS
    tokens or MAX_HIDDEN, where the experts do not route inside their kernels at this slot count or
    the finalize is not fused; measured at start-up; the default tile where nothing was measured."""
    if not _fused_entry_runs(x, block):
        return None
    return _NORM_ROUTES.get(
        _norm_route_key(block.gate.weight, x.shape[0]), moe_norm_router.NORM_ROUTER_TILES[0]
    )


def _fused_entry_runs(x: torch.Tensor, block) -> bool:
    num_tokens, hidden = x.shape
    num_slots = num_tokens * block.top_k
    if num_tokens > moe_norm_router.MAX_TOKENS or hidden > moe_norm_router.MAX_HIDDEN:
        return False
    return block.experts.routes_slots(num_slots) and fuse_finalize(x, num_slots)


def _norm_route_key(gate: torch.Tensor, num_tokens: int) -> tuple:
    return (tuple(gate.shape), gate.dtype, gate.device, tiles.slots_bucket(num_tokens))


def _time_norm_route(block, num_tokens: int) -> dict:
    """us of block.forward_after_attention at num_tokens tokens (TP = 1) per entry: None (the plain
    sequence) and each NormRouterTile. A tile that cannot run here, or whose output is off the plain
    entry's by more than linear_choice.AGREEMENT of its largest value, is left out with a warning."""
    gate = block.gate.weight
    g = torch.Generator(device=gate.device).manual_seed(num_tokens)
    rows = [torch.randn(num_tokens, gate.shape[1], device=gate.device, generator=g) for _ in range(2)]
    partial, residual = (r.to(gate.dtype) for r in rows)
    weight = torch.ones(gate.shape[1], device=gate.device, dtype=gate.dtype)
    comm, key, times, plain = SingleRankCommunicator(), _norm_route_key(gate, num_tokens), {}, None

    def call():
        return block.forward_after_attention(partial, residual, weight, weight, 1e-6, comm)

    try:
        for entry in (None, *moe_norm_router.NORM_ROUTER_TILES):
            _NORM_ROUTES[key] = entry
            try:
                normed, new_residual = call()
            except (OutOfResources, CompilationError) as error:
                log.warning("MoE entry %s left out: %s", entry.label(), error)
                continue
            if plain is None:
                plain = (normed.float(), new_residual)
            elif not torch.equal(new_residual, plain[1]) or (
                (normed.float() - plain[0]).abs().max() > AGREEMENT * plain[0].abs().max()
            ):
                log.warning("MoE entry %s left out: its output is off the plain entry's", entry.label())
                continue
            times[entry] = graph_us([call], 16, 5, 3)
    finally:
        del _NORM_ROUTES[key]
    return times


def _choose_norm_routes(model: nn.Module, max_decode_rows: int) -> None:
    """Records, per router shape and token bucket up to the decode rows, whether SparseMoeBlocks enter
    fused (and at which tile) or plain: timed through the block itself, after every other choice here
    is recorded (the fused entry depends on the slot tile and the finalize route). TP = 1 only."""
    seen: set = set()
    for block in model.modules():
        gate = _softmax_router(block)
        if gate is not None and gate.is_cuda:
            for key, entry in _norm_route_decisions(block, max_decode_rows, seen):
                _NORM_ROUTES[key] = entry


def _norm_route_decisions(block, max_decode_rows: int, seen: set) -> list[tuple]:
    """(key, the fastest entry: a NormRouterTile or None for plain) per token bucket of block up to the
    decode rows where the fused entry can run at all; plain unless a tile beats it by ENTRY_MARGIN."""
    gate, out, tokens = block.gate.weight, [], 1
    while tokens <= min(max(max_decode_rows, 1), moe_norm_router.MAX_TOKENS):
        key = _norm_route_key(gate, tokens)
        probe = gate.new_empty(tokens, gate.shape[1])
        if key not in seen and _fused_entry_runs(probe, block):
            seen.add(key)
            times = _time_norm_route(block, tokens)
            best = min(times, key=lambda t: (times[t], t is not None))
            if best is not None and times[best] > (1 - ENTRY_MARGIN) * times[None]:
                best = None  # within noise of plain: keep the unfused kernels' numerics
            out.append((key, best))
            described = (f"{t.label() if t else 'plain'} {us:.1f} us" for t, us in times.items())
            log.info("MoE entry (add + norm, router, top-k) <= %d tokens: %s", tokens, ", ".join(described))
        tokens *= 2
    return out


def fuse_finalize(x: torch.Tensor, num_slots: int) -> bool:
    """Whether the TP = 1 MoE finalize runs fused for x [T, H] with num_slots = T * k (measured at
    start-up; True where nothing was measured)."""
    key = (x.shape[-1], x.dtype, x.device, tiles.slots_bucket(num_slots))
    return _FUSED_FINALIZE.get(key, True)


def _time_finalize(hidden: int, dtype, device, num_tokens: int, top_k: int) -> tuple[float, float]:
    """(fused us, plain us) of the finalize at num_tokens tokens."""
    slots = torch.randn(num_tokens * top_k, hidden, device=device).to(dtype)
    residual = torch.randn(num_tokens, hidden, device=device).to(dtype)
    weight = torch.ones(hidden, device=device, dtype=dtype)
    fused = graph_us([lambda: moe_finalize_triton(slots, top_k, residual, weight, 1e-6)], 16, 5, 3)

    def plain_call():
        return fused_add_rmsnorm_triton(fused_moe.combine_slots_triton(slots, top_k), residual, weight, 1e-6)

    return fused, graph_us([plain_call], 16, 5, 3)


@dataclass(frozen=True)
class MoeChoice:
    w13_shape: tuple[int, ...]
    slots_bucket: int
    tile: MoeTile
    us: float
    default_us: float

    def describe(self) -> str:
        e, two_i, h = self.w13_shape
        return (
            f"experts {e}x{two_i}x{h} at <= {self.slots_bucket} slots: {self.tile.label()} "
            f"({self.us:.1f} us, default {self.default_us:.1f} us)"
        )


def slot_buckets(top_k: int, max_decode_rows: int, max_prefill_tokens: int) -> list[int]:
    """Power-of-two slot buckets from one token up to the largest decode step and prefill chunk."""
    top = tiles.slots_bucket(top_k * max(max_decode_rows, max_prefill_tokens, 1))
    buckets, b = [], tiles.slots_bucket(top_k)
    while b <= top:
        buckets.append(b)
        b *= 2
    return buckets


def _time_tile(experts, tile: MoeTile, num_tokens: int, top_k: int) -> float:
    """us per call of the experts at tile; inf when the tile cannot run here (too much shared memory,
    e.g. float32 weights in a tile sized for bf16)."""
    try:
        return _graph_time_tile(experts, tile, num_tokens, top_k)
    except OutOfResources:
        return math.inf


def _graph_time_tile(experts, tile: MoeTile, num_tokens: int, top_k: int) -> float:
    w13, w2 = experts.w13, experts.w2
    g = torch.Generator(device=w13.device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, w13.shape[2], device=w13.device, generator=g).to(w13.dtype)
    scores = torch.rand(num_tokens, w13.shape[0], device=w13.device, generator=g)
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    weights = torch.full((num_tokens, top_k), 1.0 / top_k, device=w13.device)
    return graph_us([lambda: fused_moe.fused_experts_triton(x, w13, w2, weights, ids, tile=tile)],
                    min_launches=4, replays=3, samples=3)  # fmt: skip


def _with_fastest_down(experts, tile: MoeTile, num_tokens: int, top_k: int) -> MoeTile:
    """tile with the per-slot down product's fastest shape (tiles.SLOT_DOWN_SHAPES and the tile's
    own, timed alone on random routing; its own kept on a tie): the down product's K is the
    intermediate size, so the gate/up product's best shape need not be its best."""
    w2 = experts.w2
    g = torch.Generator(device=w2.device).manual_seed(num_tokens + 1)
    num_slots = num_tokens * top_k
    act = torch.randn(num_slots, w2.shape[2], device=w2.device, generator=g).to(w2.dtype)
    ids = torch.rand(num_tokens, w2.shape[0], device=w2.device, generator=g).topk(top_k, dim=-1).indices
    ids = ids.to(torch.int32).reshape(-1).contiguous()
    weights = torch.full((num_slots,), 1.0 / top_k, device=w2.device)
    out = torch.empty(num_slots, w2.shape[1], dtype=w2.dtype, device=w2.device)
    own = tile.down_shape()
    times = {}
    for shape in dict.fromkeys((own, *tiles.SLOT_DOWN_SHAPES)):
        call = lambda s=shape: slot_down(act, w2, out, weights, ids, s, tile.num_stages)  # noqa: E731
        try:
            times[shape] = graph_us([call], min_launches=8, replays=5, samples=3)
        except (OutOfResources, CompilationError) as error:
            log.warning("per-slot down shape %s left out: %s", shape, error)
    if not times:
        return tile
    best = min(times, key=lambda s: (times[s], s != own))
    log.info("per-slot down product at %d slots: %s", num_slots,
             ", ".join(f"{n}x{k} w{w} {us:.1f} us" for (n, k, w), us in times.items()))  # fmt: skip
    return tile if best == own else dataclasses.replace(tile, down=best)


@torch.inference_mode()
def choose(
    model: nn.Module, max_decode_rows: int, max_prefill_tokens: int, tp_size: int = 1, agree=None
) -> list[MoeChoice]:
    """Times and records the tile of every distinct FusedMoE shape of model at each slot bucket, the
    router route at each token bucket, and at tp_size 1 the finalize route. Runs on the GPU before any
    CUDA graph is captured; returns the tile decisions (none on CPU). agree(decisions) -> decisions:
    for tensor-parallel ranks, rank 0's list for every rank (engine/tp_rank.py)."""
    seen, measured, decisions = set(), [], []  # decisions: (table, key without the device, value)
    tensors: dict[tuple, torch.Tensor] = {}  # (table, key) -> the weight whose device it is recorded for
    for block in model.modules():  # MoE blocks: a top_k and experts with unquantized w13 / w2
        if not hasattr(block, "top_k"):
            continue
        if any(p.is_cuda for p in block.parameters()):  # the router is timed for quantized experts too
            decisions += _route_decisions(block, max_decode_rows, seen, tensors)
        experts = getattr(block, "experts", None)
        if hasattr(getattr(experts, "method", None), "route_candidates"):  # quantized experts
            if any(p.is_cuda for p in experts.parameters()):
                buckets = slot_buckets(block.top_k, max_decode_rows, max_prefill_tokens)
                decisions += _slot_route_decisions(block, buckets, seen, tensors)
            continue
        if not hasattr(experts, "w13"):
            continue
        if experts.w13.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            continue  # FP8 experts (a w13 of e4m3 codes) run kernels/quant_moe.py, not these tiles
        if not experts.w13.is_cuda:
            continue
        for bucket in slot_buckets(block.top_k, max_decode_rows, max_prefill_tokens):
            key = (tuple(experts.w13.shape), experts.w13.dtype, bucket)
            if key in seen:
                continue
            seen.add(key)
            num_tokens = max(bucket // block.top_k, 1)
            decode = bucket <= tiles.DECODE_MAX_SLOTS
            candidates = tiles.DECODE_TILES if decode else tiles.PREFILL_TILES
            times = [(_time_tile(experts, t, num_tokens, block.top_k), i) for i, t in enumerate(candidates)]
            us, best = min(times)
            tile = candidates[best]
            if tile.block_m == 1:
                tile = _with_fastest_down(experts, tile, num_tokens, block.top_k)
            decisions.append(("tile", key, tile))
            tensors[("tile", key)] = experts.w13
            measured.append((key, us, times[0][0]))
            if tp_size == 1:
                hidden, dtype, device = experts.hidden_size, experts.w13.dtype, experts.w13.device
                fused_us, plain_us = _time_finalize(hidden, dtype, device, num_tokens, block.top_k)
                decisions.append(("finalize", (hidden, dtype, bucket), fused_us <= plain_us))
                tensors[("finalize", (hidden, dtype, bucket))] = experts.w13
                log.info("MoE finalize <= %d slots: fused %.1f us, plain %.1f us", bucket, fused_us, plain_us)
    if agree is not None:
        agreed = agree(decisions)
        if [(t, k) for t, k, _ in agreed] != [(t, k) for t, k, _ in decisions]:
            raise RuntimeError("tensor-parallel ranks measured different MoE cases; they must load one model")
        decisions = agreed
    decided = _apply(decisions, tensors, measured)
    if tp_size == 1:
        _choose_norm_routes(model, max_decode_rows)
    return decided


def _slot_route_decisions(block, buckets: list[int], seen: set, tensors: dict) -> list[tuple]:
    """("slots", key, the fastest route) per slot bucket of block's quantized experts
    (model/quant/experts.py: route_candidates), the default kept on a tie."""
    experts, top_k = block.experts, block.top_k
    codes = experts.method.stacks(experts)[0].codes
    out = []
    for bucket in buckets:
        key = (tuple(codes.shape), "slots", bucket)
        candidates = experts.method.route_candidates(experts, bucket)
        if key in seen or len(candidates) < 2:
            continue
        seen.add(key)
        times = _time_slot_routes(experts, codes, candidates, max(bucket // top_k, 1), top_k)
        if not times:  # every candidate failed here: the default route stays (and will say why)
            continue
        out.append(("slots", key, min(times, key=lambda r: (times[r], r != candidates[0]))))
        tensors[("slots", key)] = codes
        described = (f"{_route_label(r)} {us:.1f} us" for r, us in times.items())
        log.info("quantized experts %s <= %d slots: %s", tuple(codes.shape), bucket, ", ".join(described))
    return out


def _route_label(route) -> str:
    return "w8a16 slots" if route is None else route.label()


def _time_slot_routes(experts, codes, candidates: tuple, num_tokens: int, top_k: int) -> dict:
    """us per call of each candidate slot route of experts (gate/up codes: codes) at num_tokens tokens
    of random routing. A route that fails to compile or fit, or whose product is off the first
    candidate's by more than linear_choice.AGREEMENT of its largest value (a wrong scale or layout on
    this GPU is off by about 100 %; W8A8's rounding by a few %), is left out with a warning."""
    method = experts.method
    g = torch.Generator(device=codes.device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, experts.hidden_size, device=codes.device, generator=g).bfloat16()
    scores = torch.rand(num_tokens, codes.shape[0], device=codes.device, generator=g)
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    weights = torch.full((num_tokens, top_k), 1.0 / top_k, device=codes.device)
    times, first = {}, None
    for route in candidates:
        try:
            product = method.run_slots(experts, x, weights, ids, route).float()
        except (OutOfResources, CompilationError) as error:
            log.warning("quantized experts: slot route %s left out: %s", _route_label(route), error)
            continue
        if first is None:
            first = product
        elif (product - first).abs().max() > AGREEMENT * first.abs().max():
            log.warning(
                "quantized experts: slot route %s left out: product off the first", _route_label(route)
            )
            continue
        call = lambda r=route: method.run_slots(experts, x, weights, ids, r)  # noqa: E731
        times[route] = graph_us([call], min_launches=8, replays=5, samples=3)
    return times


def _softmax_router(block) -> torch.Tensor | None:
    """The router weight of a SparseMoeBlock-like block (a `gate` linear and a softmax top-k with
    `renormalize`), None for anything else (DeepSeek-V3's grouped sigmoid routing, say)."""
    gate = getattr(getattr(block, "gate", None), "weight", None)
    return None if gate is None or getattr(block, "renormalize", None) is None else gate


def _route_decisions(block, max_decode_rows: int, seen: set, tensors: dict) -> list[tuple]:
    """("route", key, the fastest RouteTile or None) per token bucket of block's router up to the
    decode rows. A routed block offers router_weight and route_with(x, tile) (SparseMoeBlock's softmax
    top-k, DeepseekV3MoE's grouped top-k)."""
    gate = getattr(block, "router_weight", None)
    if gate is None:
        return []
    out, tokens = [], 1
    while tokens <= min(max(max_decode_rows, 1), moe_router.MAX_TOKENS):
        key = (tuple(gate.shape), gate.dtype, tiles.slots_bucket(tokens))
        if ("route", key) not in seen:
            seen.add(("route", key))
            times = _time_route(block, tokens)
            best = min(times, key=lambda t: (times[t], t is not None))  # a tie keeps linear + top-k
            out.append(("route", key, best))
            tensors[("route", key)] = gate
            described = (f"{t.label() if t else 'linear + top-k'} {us:.1f} us" for t, us in times.items())
            log.info("MoE router %s <= %d tokens: %s", tuple(gate.shape), tokens, ", ".join(described))
        tokens *= 2
    return out


def _apply(decisions: list[tuple], tensors: dict, measured: list) -> list[MoeChoice]:
    """Records every decision for this rank's tensors; the tile choices, described and logged."""
    timings = {key: (us, default_us) for key, us, default_us in measured}
    decided = []
    for table, key, value in decisions:
        if table == "tile":
            tiles.set_tile(tensors[("tile", key)], key[2], value)
            us, default_us = timings[key]
            decided.append(MoeChoice(key[0], key[2], value, us, default_us))
        elif table == "slots":
            set_slot_route(tensors[(table, key)], key[2], value)
        elif table == "finalize":
            hidden, dtype, bucket = key
            _FUSED_FINALIZE[(hidden, dtype, tensors[(table, key)].device, bucket)] = value
        else:
            _ROUTE_TILES[(key[0], key[1], tensors[(table, key)].device, key[2])] = value
    if decided:
        log.info("fused-MoE tiles: %s", "; ".join(c.describe() for c in decided))
    return decided
