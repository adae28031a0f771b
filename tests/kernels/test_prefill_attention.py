"""Triton paged prefill attention against the float64 reference: first prefill, chunked prefill
after cached prefix blocks, speculative verify, and empty sequences in one batch."""

import pytest
import torch

from tests.kernels.paged import assert_close_to_float64, random_paged_kv
from tpfuse.kernels import warm_up_prefill_attention
from tpfuse.kernels.prefill_attention import (
    compile_prefill_variants,
    prefill_attention_launch,
    prefill_attention_ref,
    prefill_attention_triton,
)

# (context length, query length): a first prefill, a chunk after a cached prefix, a verify of 4
# tokens, a sequence with no query tokens this pass, a single-token query.
MIXED_BATCH = [(11, 11), (29, 6), (23, 4), (9, 0), (1, 1)]


def _case(pairs, block_size, num_kv_heads, group, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables, seq_lens = random_paged_kv(
        [ctx for ctx, _ in pairs], block_size, num_kv_heads, head_dim, dtype, gen
    )
    q_lens = torch.tensor([q for _, q in pairs])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(q_lens.sum()), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, int(q_lens.max())


def _expected(q, k_cache, v_cache, *rest):
    return prefill_attention_ref(q.double(), k_cache.double(), v_cache.double(), *rest)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_attention_matches_float64_reference_on_a_mixed_batch(group, block_size, dtype):
    case = _case(MIXED_BATCH, block_size, 2, group, 16, dtype, seed=group + block_size)
    out = prefill_attention_triton(*case, 0.25)
    assert_close_to_float64(out, _expected(*case, 0.25), dtype)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (16, 32), (32, 16)])
def test_prefill_attention_with_several_query_and_key_tiles(block_m, block_n):
    case = _case([(70, 45), (40, 17), (33, 33)], 4, 1, 2, 32, torch.float32, seed=block_m * block_n)
    out = prefill_attention_launch(*case, 0.2, block_m=block_m, block_n=block_n)
    assert_close_to_float64(out, _expected(*case, 0.2), torch.float32)


@pytest.mark.parametrize("group", [3, 4])
def test_prefill_attention_tiles_that_split_a_tokens_query_heads(group):
    # a tile packs (token, head in group) rows: with 16-row tiles and a group of 3 a token's heads
    # straddle two tiles, and each tile's causal bound must come from its own last token
    case = _case([(37, 23), (9, 4), (18, 1)], 4, 2, group, 16, torch.float32, seed=group)
    out = prefill_attention_launch(*case, 0.2, block_m=16, block_n=16)
    assert_close_to_float64(out, _expected(*case, 0.2), torch.float32)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_attention_with_keys_split_over_programs_and_merged(num_splits, group):
    # verify-like queries (several tokens per sequence, one tile each), contexts from shorter than one
    # split's share to many key tiles, and an empty sequence
    case = _case([(70, 4), (3, 3), (9, 0), (33, 2)], 4, 2, group, 16, torch.float32, seed=num_splits)
    out = prefill_attention_launch(*case, 0.2, block_m=16, block_n=16, num_splits=num_splits)
    expected = _expected(*case, 0.2)
    assert_close_to_float64(out, expected, torch.float32)


def test_the_dispatching_op_splits_the_keys_of_a_batch_1_verify(monkeypatch):
    import tpfuse.kernels.prefill_attention as module

    seen = []
    launch = module.prefill_attention_launch
    monkeypatch.setattr(
        module, "prefill_attention_launch", lambda *a, **k: seen.append(a[-1]) or launch(*a, **k)
    )
    case = _case([(300, 4)], 16, 2, 4, 16, torch.float32, seed=4)
    out = prefill_attention_triton(*case, 0.2)
    assert seen and seen[0] > 1  # split over programs (8 SMs stand in on CPU)
    assert_close_to_float64(out, _expected(*case, 0.2), torch.float32)


def test_prefill_attention_head_dim_that_is_not_a_power_of_two():
    case = _case([(12, 5), (7, 7)], 4, 2, 2, 24, torch.float32, seed=3)
    out = prefill_attention_triton(*case, 0.3)
    assert_close_to_float64(out, _expected(*case, 0.3), torch.float32)


def test_prefill_attention_last_query_of_a_verify_equals_decode_at_that_position():
    from tpfuse.kernels.decode_attention import decode_attention_ref

    q, k_cache, v_cache, tables, lens, starts, max_q = _case([(21, 3)], 4, 2, 2, 16, torch.float32, seed=8)
    out = prefill_attention_triton(q, k_cache, v_cache, tables, lens, starts, max_q, 0.25)
    decode = decode_attention_ref(q[-1:].double(), k_cache.double(), v_cache.double(), tables, lens, 0.25)
    assert_close_to_float64(out[-1:], decode, torch.float32)


@pytest.mark.parametrize("tree", [False, True])
def test_compiling_the_prefill_variants_ahead_launches_each_tile_config_and_only_reads_the_caches(tree):
    # group 4, head_dim 64: query tiles of 16 (1-4 tokens), 32 (8), 64 (16) and 128 rows (32 and
    # more), each with keys whole and split, each with and without a tree mask when tree drafting
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(6, 16, 2, 64, generator=gen)
    v_cache = torch.randn(6, 16, 2, 64, generator=gen)
    before = k_cache.clone(), v_cache.clone()
    launches = compile_prefill_variants(k_cache, v_cache, 8, max_query_len=8192, tree=tree)
    assert launches == 4 * 2 * (2 if tree else 1)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    # a small batch budget never meets the larger tiles
    assert compile_prefill_variants(k_cache, v_cache, 8, max_query_len=3, tree=False) == 2


def test_the_engine_warm_up_compiles_nothing_where_nothing_compiles_at_first_use():
    k_cache = torch.zeros(2, 16, 2, 64)
    assert warm_up_prefill_attention(k_cache, k_cache, 8, 8192, tree=False) == 0  # CPU tensors
