"""Which slot route quantized experts run (model/quant/experts.py): the one start-up timing
(model/moe_choice.py) recorded for the experts' shape and slot bucket, else per slot W8A16 at decode
sizes and the grouped GEMMs above; W8A8 candidates only where the format quantizes activations and
the GPU has FP8 tensor cores."""

from types import SimpleNamespace

import pytest
import torch

from tpfuse import knobs
from tpfuse.kernels.fused_moe_tiles import DECODE_MAX_SLOTS
from tpfuse.kernels.quant_fp8 import FP8_DTYPE
from tpfuse.kernels.quant_moe import quant_slots_triton
from tpfuse.kernels.quant_moe_grouped import GROUPED_TILES, grouped_slots_triton
from tpfuse.kernels.quant_moe_w8a8 import SLOT_TILES, w8a8_slots_triton
from tpfuse.model.quant import experts as quant_experts
from tpfuse.model.quant.experts import Fp8Experts


def _experts(gen, num=4, hidden=256, inter=64):
    """What Fp8Experts("channel") reads of an experts module."""
    return SimpleNamespace(
        w13=(torch.randn(num, 2 * inter, hidden, generator=gen) * 2).to(FP8_DTYPE),
        w2=(torch.randn(num, hidden, inter, generator=gen) * 2).to(FP8_DTYPE),
        w13_scale=torch.rand(num, 2 * inter, 1, generator=gen) * 0.05 + 1e-3,
        w2_scale=torch.rand(num, hidden, 1, generator=gen) * 0.05 + 1e-3,
        hidden_size=hidden,
        intermediate_local=inter,
    )


@pytest.mark.parametrize("activations", [True, False])
def test_a_cpu_or_a_weight_only_format_races_no_w8a8_route(activations):
    experts = _experts(torch.Generator().manual_seed(0))
    method = Fp8Experts("channel", None, activations)
    assert method.route_candidates(experts, 8) == (None, *GROUPED_TILES)
    assert method.route_candidates(experts, 2 * DECODE_MAX_SLOTS) == GROUPED_TILES


def test_the_recorded_route_is_the_one_that_runs(monkeypatch):
    monkeypatch.setenv(knobs.KERNELS, "triton")
    knobs.reload()
    monkeypatch.setattr(quant_experts, "_SLOT_ROUTES", {})
    gen = torch.Generator().manual_seed(1)
    experts, method = _experts(gen), Fp8Experts("channel", None)
    x = torch.randn(2, 256, generator=gen)
    ids = torch.tensor([[0, 3], [2, 1]], dtype=torch.int32)
    weights = torch.rand(2, 2, generator=gen)
    w13, w2 = method.stacks(experts)
    w8a16 = quant_slots_triton(x, w13, w2, weights, ids)
    assert torch.equal(method.apply_slots(experts, x, weights, ids), w8a16)  # nothing measured
    quant_experts.set_slot_route(experts.w13, 4, SLOT_TILES[0])  # 2 tokens x top-2: bucket 4
    w8a8 = method.apply_slots(experts, x, weights, ids)
    assert torch.equal(w8a8, w8a8_slots_triton(x, w13, w2, weights, ids, SLOT_TILES[0]))
    assert not torch.equal(w8a8, w8a16)  # the activations' rounding: another route ran
    ids8 = ids.repeat(3, 1)  # 6 tokens: bucket 16, nothing recorded there
    out = method.apply_slots(experts, x.repeat(3, 1), weights.repeat(3, 1), ids8)
    assert torch.equal(out, quant_slots_triton(x.repeat(3, 1), w13, w2, weights.repeat(3, 1), ids8))
    quant_experts.set_slot_route(experts.w13, 16, GROUPED_TILES[1])
    out = method.apply_slots(experts, x.repeat(3, 1), weights.repeat(3, 1), ids8)
    assert torch.equal(
        out, grouped_slots_triton(x.repeat(3, 1), w13, w2, weights.repeat(3, 1), ids8, GROUPED_TILES[1])
    )


def test_unmeasured_steps_above_the_decode_sizes_run_the_grouped_gemms(monkeypatch):
    monkeypatch.setattr(quant_experts, "_SLOT_ROUTES", {})
    codes = torch.zeros(4, 8, 16, dtype=FP8_DTYPE)
    assert quant_experts.slot_route(codes, DECODE_MAX_SLOTS) is None
    assert quant_experts.slot_route(codes, DECODE_MAX_SLOTS + 1) == GROUPED_TILES[0]


def test_start_up_records_the_fastest_route_and_keeps_the_default_on_a_tie(monkeypatch):
    """model/moe_choice.py's decision per slot bucket, with the timings given: the fastest route wins,
    a tie keeps the bucket's default (its first candidate), a bucket where no route ran is left out."""
    from tpfuse.model import moe_choice

    monkeypatch.setattr(quant_experts, "_SLOT_ROUTES", {})
    experts = _experts(torch.Generator().manual_seed(2))
    experts.method = Fp8Experts("channel", None)
    block = SimpleNamespace(experts=experts, top_k=2)
    timings = {  # by slots bucket: route -> us
        2: {None: 5.0, GROUPED_TILES[0]: 3.0, GROUPED_TILES[1]: 4.0},
        4: {None: 3.0, GROUPED_TILES[0]: 3.0},
        8: {},
    }
    monkeypatch.setattr(moe_choice, "_time_slot_routes", lambda e, codes, c, tokens, k: timings[tokens * k])
    tensors = {}
    decisions = moe_choice._slot_route_decisions(block, [2, 4, 8], set(), tensors)
    assert [(key[2], route) for _, key, route in decisions] == [(2, GROUPED_TILES[0]), (4, None)]
    moe_choice._apply(decisions, tensors, [])
    assert quant_experts.slot_route(experts.w13, 2) == GROUPED_TILES[0]
    assert quant_experts.slot_route(experts.w13, 4) is None


@pytest.mark.parametrize("fmt", ["fp8-block-qwen3-moe", "int4-group32-qwen3-moe"])
def test_a_quantized_moe_model_gives_the_reference_logits_on_the_triton_routes(fmt, tmp_path, monkeypatch):
    """A tiny Qwen3-MoE checkpoint in FP8 blocks / INT4 groups of 32 (the public layouts), prefill on
    the grouped GEMMs (the decode sizes lowered to 4 slots) and decode per slot, interpreted on CPU:
    the logits of the torch reference path."""
    from tests.model.harness import load_for_test, relative_error, run_prefill_then_decode
    from tests.model.quant_checkpoints import write_quantized
    from tests.model.test_quantized_checkpoints import FORMATS

    kind, quantizer, config, shape = FORMATS[fmt]
    write_quantized(tmp_path, kind, quantizer, config, **shape)
    model, _ = load_for_test(tmp_path)
    monkeypatch.setattr(quant_experts, "_SLOT_ROUTES", {})
    monkeypatch.setattr(quant_experts, "DECODE_MAX_SLOTS", 4)
    runs = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv(knobs.KERNELS, mode)
        knobs.reload()
        runs[mode] = run_prefill_then_decode(model, [[3, 1, 4, 1, 5], [9, 2, 6]], [[7, 8]])
    assert relative_error(runs["triton"][0], runs["torch"][0]) <= 1e-4  # 8 tokens: grouped
    assert relative_error(runs["triton"][1][0], runs["torch"][1][0]) <= 1e-4  # 2 tokens: per slot


def _int4_experts(gen, dtype, num=4, hidden=256, inter=64, group=32):
    """What IntGroupExperts(4, group) reads of an experts module."""
    from tpfuse.kernels import quant_int

    def packed(n, k):
        return torch.stack(
            [quant_int.pack_int(torch.randint(0, 16, (n, k), generator=gen), 4) for _ in range(num)]
        )

    return SimpleNamespace(
        w13_packed=packed(2 * inter, hidden),
        w2_packed=packed(hidden, inter),
        w13_scale=(torch.rand(num, 2 * inter, hidden // group, generator=gen) * 0.05 + 1e-3).to(dtype),
        w2_scale=(torch.rand(num, hidden, inter // group, generator=gen) * 0.05 + 1e-3).to(dtype),
        hidden_size=hidden,
        intermediate_local=inter,
        dtype=dtype,
    )


def test_int4_experts_race_the_half2_slots_at_decode_sizes_only_where_they_fit():
    from tpfuse.kernels.quant_moe import HALF2_SLOT_TILES
    from tpfuse.model.quant.experts import IntGroupExperts

    gen = torch.Generator().manual_seed(3)
    method = IntGroupExperts(4, 32)
    bf16 = _int4_experts(gen, torch.bfloat16)
    assert method.route_candidates(bf16, 8) == (None, *GROUPED_TILES, *HALF2_SLOT_TILES)
    assert method.route_candidates(bf16, 2 * DECODE_MAX_SLOTS) == GROUPED_TILES
    assert method.route_candidates(_int4_experts(gen, torch.float32), 8) == (None, *GROUPED_TILES)
    odd = _int4_experts(gen, torch.bfloat16, inter=48, group=16)  # groups of 16 split a 32-code vector
    assert IntGroupExperts(4, 16).route_candidates(odd, 8) == (None, *GROUPED_TILES)


def test_a_recorded_half2_route_runs_and_survives_the_tensor_parallel_broadcast(monkeypatch):
    """Rank 0's decision reaches the other ranks pickled (engine/tp_rank.rank0_decides)."""
    import pickle

    from tpfuse.kernels.quant_moe import HALF2_SLOT_TILES
    from tpfuse.model.quant.experts import IntGroupExperts

    monkeypatch.setenv(knobs.KERNELS, "triton")
    knobs.reload()
    monkeypatch.setattr(quant_experts, "_SLOT_ROUTES", {})
    gen = torch.Generator().manual_seed(4)
    experts, method = _int4_experts(gen, torch.bfloat16), IntGroupExperts(4, 32)
    x = torch.randn(2, 256, generator=gen).bfloat16()
    ids = torch.tensor([[0, 3], [2, 1]], dtype=torch.int32)
    weights = torch.rand(2, 2, generator=gen)
    w13, w2 = method.stacks(experts)
    route = pickle.loads(pickle.dumps(HALF2_SLOT_TILES[1]))
    assert route == HALF2_SLOT_TILES[1] and route.label() == HALF2_SLOT_TILES[1].label()
    quant_experts.set_slot_route(experts.w13_packed, 4, route)
    out = method.apply_slots(experts, x, weights, ids)
    assert torch.equal(out, quant_slots_triton(x, w13, w2, weights, ids, tile=route))
    expected = method.apply_slots(experts, x.float(), weights, ids).double()  # fp32: the W8A16 route
    assert (out.double() - expected).abs().max() <= 3e-2 * expected.abs().max()
