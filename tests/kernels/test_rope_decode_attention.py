"""Triton rope_decode_attention ((q/k norm +) rope + the step's KV store + decode attention in one launch)
against a float64 reference, and against the two-launch path it replaces (rope/store, then decode
attention): the same cache bits and outputs."""

import pytest
import torch

from tests.kernels.paged import assert_close_to_float64, random_paged_kv
from tpfuse.kernels.decode_attention import decode_attention_launch, decode_attention_ref
from tpfuse.kernels.paged_attention_common import choose_num_splits
from tpfuse.kernels.qk_norm_rope_store_kv import qk_norm_rope_store_kv_ref, qk_norm_rope_store_kv_triton
from tpfuse.kernels.rope import rope_cos_sin_cache
from tpfuse.kernels.rope_decode_attention import (
    fuses,
    rope_decode_attention_launch,
    rope_decode_attention_ref,
    rope_decode_attention_triton,
)
from tpfuse.kernels.rope_store_kv import rope_store_kv_ref, rope_store_kv_triton

EPS, SCALE = 1e-6, 0.21


def decode_step_case(context_lens, num_kv_heads, group, head_dim, dtype, seed, block_size=4, device="cpu"):
    """A decode step: q, k, v views of one fused qkv row per sequence, the cache holding keys
    0 .. seq_len - 2 of each sequence and NaN in the slot of the step's token (key seq_len - 1, at
    slot_mapping), norm weights near 1, positions seq_len - 1. Returns (keyword arguments, norms)."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables, lens = random_paged_kv(
        context_lens, block_size, num_kv_heads, head_dim, dtype, gen, device=device
    )
    batch, num_heads = len(context_lens), num_kv_heads * group
    qkv = torch.randn(batch, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 2
    qkv = qkv.to(device=device, dtype=dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = q.view(batch, num_heads, head_dim), k.view(batch, -1, head_dim), v.view(batch, -1, head_dim)
    last = (lens - 1).clamp(min=0).long()
    slots = (
        tables[torch.arange(batch, device=device), last // block_size].long() * block_size + last % block_size
    )
    slots[lens <= 0] = -1
    for cache in (k_cache, v_cache):
        cache.view(-1, num_kv_heads, head_dim)[slots[slots >= 0]] = float("nan")
    norms = tuple(
        (1 + 0.5 * torch.randn(head_dim, generator=gen)).to(device=device, dtype=dtype) for _ in range(2)
    )
    cos_sin = rope_cos_sin_cache(head_dim, 1 << 15, 10000.0).to(device)
    return dict(positions=last, q=q, k=k, v=v, cos_sin_cache=cos_sin, k_cache=k_cache, v_cache=v_cache,
                slot_mapping=slots, block_tables=tables, seq_lens=lens), norms  # fmt: skip


def float64_expected(args, norms, round_rotated=False):
    """(out, k_cache, v_cache) of the reference in float64 on copies. round_rotated: q and k normed,
    rotated and stored in the activation dtype first (rounded as every path rounds them) and only the
    attention in float64: the comparison for bf16 at real head sizes, where one rounding of q moves a
    peaked softmax by more than the output's tolerance."""
    a = {name: t.clone() for name, t in args.items()}
    if round_rotated:
        rope = (a["positions"], a["q"], a["k"], a["v"], a["cos_sin_cache"], a["k_cache"], a["v_cache"])
        if norms is None:
            rope_store_kv_ref(*rope, a["slot_mapping"])
        else:
            qk_norm_rope_store_kv_ref(*rope[:4], norms[0], norms[1], EPS, *rope[4:], a["slot_mapping"])
        a = {name: (t.double() if t.is_floating_point() else t) for name, t in a.items()}
        out = decode_attention_ref(
            a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], SCALE
        )
        return out, a["k_cache"], a["v_cache"]
    a = {name: (t.double() if t.is_floating_point() else t) for name, t in a.items()}
    qk_norm = None if norms is None else (a_norm.double() for a_norm in norms)
    qk_norm = None if norms is None else (*qk_norm, EPS)
    out = rope_decode_attention_ref(**a, scale=SCALE, qk_norm=qk_norm)
    return out, a["k_cache"], a["v_cache"]


def _two_launches(args, norms, num_splits, block_n):
    """The path the fused kernel replaces, on copies: (out, k_cache, v_cache)."""
    a = {name: t.clone() for name, t in args.items()}
    rope_args = (a["positions"], a["q"], a["k"], a["v"], a["cos_sin_cache"], a["k_cache"], a["v_cache"])
    if norms is None:
        rope_store_kv_triton(*rope_args, a["slot_mapping"])
    else:
        qk_norm_rope_store_kv_triton(
            *rope_args[:4], norms[0], norms[1], EPS, *rope_args[4:], a["slot_mapping"]
        )
    out = decode_attention_launch(a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"], SCALE,
                                  num_splits, block_n=block_n)  # fmt: skip
    return out, a["k_cache"], a["v_cache"]


def _same_bits(a, b):
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan())


def _assert_cache_close(actual, expected_float64, dtype):
    assert torch.equal(actual.isnan(), expected_float64.isnan()), (
        "a cache slot was written that should not be"
    )
    written = ~expected_float64.isnan()
    assert_close_to_float64(actual[written], expected_float64[written], dtype)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk_norm_rope"])
@pytest.mark.parametrize(
    "dtype,num_splits,group,head_dim",
    [
        (torch.float32, 1, 2, 32),
        (torch.float32, 3, 4, 32),
        (torch.float16, 8, 2, 64),
        (torch.float32, 2, 3, 24),
    ],
)
def test_fused_matches_float64_and_the_two_launch_path(qk_norm, dtype, num_splits, group, head_dim):
    # contexts: one key (the step's own), a split boundary at 16-key tiles, and longer ones
    args, norms = decode_step_case(
        [1, 16, 17, 45, 70], 2, group, head_dim, dtype, seed=num_splits * 10 + group
    )
    norms = norms if qk_norm else None
    q_before, k_before, v_before = args["q"].clone(), args["k"].clone(), args["v"].clone()
    expected, k_expected, v_expected = float64_expected(args, norms)
    two, k_two, v_two = _two_launches(args, norms, num_splits, block_n=16)
    qk = None if norms is None else (norms[0], norms[1], EPS)
    out = rope_decode_attention_launch(**args, scale=SCALE, num_splits=num_splits, qk_norm=qk, block_n=16)
    assert_close_to_float64(out, expected, dtype)
    _assert_cache_close(args["k_cache"], k_expected, dtype)
    _assert_cache_close(args["v_cache"], v_expected, dtype)
    assert _same_bits(args["k_cache"], k_two) and _same_bits(args["v_cache"], v_two)
    torch.testing.assert_close(out, two, atol=1e-5 if dtype == torch.float32 else 2e-3, rtol=1e-5)
    assert torch.equal(args["q"], q_before), "q was modified"
    assert torch.equal(args["k"], k_before) and torch.equal(args["v"], v_before), "k or v was modified"


@pytest.mark.parametrize("merge_in_kernel", [False, True], ids=["merge_launch", "last_split_merges"])
def test_padding_rows_store_nothing_and_give_zeros(merge_in_kernel):
    args, norms = decode_step_case([0, 33, 5], 2, 2, 32, torch.float32, seed=3)
    expected, k_expected, _ = float64_expected(args, norms)
    row_2_slot = int(args["slot_mapping"][2])
    args["slot_mapping"][2] = -1  # not stored; the row still attends to its own k and v
    before = args["k_cache"].clone()
    out = rope_decode_attention_launch(**args, scale=SCALE, num_splits=4, qk_norm=(*norms, EPS), block_n=16,
                                       merge_in_kernel=merge_in_kernel)  # fmt: skip
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close_to_float64(out, expected, torch.float32)
    flat, flat_before = args["k_cache"].view(-1, 2, 32), before.view(-1, 2, 32)
    row_1_slot = int(args["slot_mapping"][1])
    assert_close_to_float64(flat[row_1_slot], k_expected.view(-1, 2, 32)[row_1_slot], torch.float32)
    others = torch.ones(flat.shape[0], dtype=torch.bool)
    others[row_1_slot] = False
    assert _same_bits(flat[others], flat_before[others]), "a slot other than row 1's was written"
    assert flat[row_2_slot].isnan().all()


def test_the_split_rule_entry_point_matches_float64():
    # float16, not bfloat16: the CPU interpreter's bf16 dot is wrong (decode attention's own tests use
    # float16 too); the GPU test covers bf16
    args, norms = decode_step_case([9, 130, 64], 4, 4, 64, torch.float16, seed=11, block_size=16)
    expected, _, _ = float64_expected(args, norms)
    out = rope_decode_attention_triton(**args, scale=SCALE, qk_norm=(*norms, EPS))
    assert_close_to_float64(out, expected, torch.float16)


def test_norm_weights_of_the_wrong_size_are_rejected_by_name():
    args, norms = decode_step_case([5], 1, 2, 32, torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"k_norm_weight of shape \(32,\)"):
        rope_decode_attention_triton(**args, scale=SCALE, qk_norm=(norms[0], norms[1][:16], EPS))


def test_the_rounded_reference_agrees_with_the_float64_one_in_float32():
    args, norms = decode_step_case([3, 40], 2, 2, 32, torch.float32, seed=4)
    out, k_cache, _ = float64_expected(args, norms)
    rounded, k_rounded, _ = float64_expected(args, norms, round_rotated=True)
    assert_close_to_float64(rounded.float(), out, torch.float32)
    assert torch.equal(k_cache.isnan(), k_rounded.isnan())


@pytest.mark.parametrize("group", [4, 8], ids=["fused", "two_launches"])
def test_the_entry_point_takes_either_path_and_both_match_float64(group):
    args, norms = decode_step_case([150], 1, group, 32, torch.float32, seed=group, block_size=16)
    splits = choose_num_splits(1, 1, args["block_tables"].shape[1], 16, args["q"].device)
    assert splits > 1 and fuses(splits, group) == (group == 4)
    expected, k_expected, _ = float64_expected(args, norms)
    out = rope_decode_attention_triton(**args, scale=SCALE, qk_norm=(*norms, EPS))
    assert_close_to_float64(out, expected, torch.float32)
    _assert_cache_close(args["k_cache"], k_expected, torch.float32)
