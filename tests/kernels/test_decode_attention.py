"""Triton split-K paged decode attention against the float64 reference."""

import pytest
import torch

from tests.kernels.paged import assert_close_to_float64, random_paged_kv
from tpfuse.kernels.decode_attention import (
    decode_attention_launch,
    decode_attention_ref,
    decode_attention_triton,
)
from tpfuse.kernels.decode_merge import arrival_counters


def _case(context_lens, block_size, num_kv_heads, group, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables, seq_lens = random_paged_kv(
        context_lens, block_size, num_kv_heads, head_dim, dtype, gen
    )
    q = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, block_tables, seq_lens


def _expected(q, k_cache, v_cache, block_tables, seq_lens, scale):
    return decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), block_tables, seq_lens, scale)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_attention_matches_float64_reference_for_gqa_groups(group, block_size, dtype):
    q, k_cache, v_cache, tables, lens = _case([1, 13, 37], block_size, 2, group, 16, dtype, seed=group * 100)
    out = decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.25)
    assert_close_to_float64(out, _expected(q, k_cache, v_cache, tables, lens, 0.25), dtype)


@pytest.mark.parametrize("merge_in_kernel", [False, True], ids=["merge_launch", "last_split_merges"])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_decode_attention_merges_any_number_of_splits(num_splits, merge_in_kernel):
    q, k_cache, v_cache, tables, lens = _case([5, 70, 33, 2], 4, 2, 2, 32, torch.float32, seed=num_splits)
    out = decode_attention_launch(
        q, k_cache, v_cache, tables, lens, 0.17, num_splits, block_n=16, merge_in_kernel=merge_in_kernel
    )
    assert_close_to_float64(out, _expected(q, k_cache, v_cache, tables, lens, 0.17), torch.float32)


def test_decode_attention_head_dim_that_is_not_a_power_of_two():
    q, k_cache, v_cache, tables, lens = _case([9, 20], 4, 1, 4, 24, torch.float32, seed=5)
    out = decode_attention_launch(q, k_cache, v_cache, tables, lens, 0.2, num_splits=2, block_n=16)
    assert_close_to_float64(out, _expected(q, k_cache, v_cache, tables, lens, 0.2), torch.float32)


@pytest.mark.parametrize("num_splits,merge_in_kernel", [(1, False), (4, False), (4, True)])
def test_decode_attention_gives_zeros_for_a_sequence_without_keys(num_splits, merge_in_kernel):
    q, k_cache, v_cache, tables, lens = _case([6, 11], 4, 2, 2, 16, torch.float32, seed=9)
    lens[0] = 0  # a padding row of a CUDA-graph batch
    out = decode_attention_launch(
        q, k_cache, v_cache, tables, lens, 0.25, num_splits, block_n=16, merge_in_kernel=merge_in_kernel
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_close_to_float64(out[1:], _expected(q, k_cache, v_cache, tables, lens, 0.25)[1:], torch.float32)


def test_decode_attention_result_does_not_depend_on_the_split_count():
    q, k_cache, v_cache, tables, lens = _case([50, 3], 4, 1, 2, 16, torch.float32, seed=2)
    one = decode_attention_launch(q, k_cache, v_cache, tables, lens, 0.3, num_splits=1, block_n=16)
    many = decode_attention_launch(q, k_cache, v_cache, tables, lens, 0.3, num_splits=5, block_n=16)
    torch.testing.assert_close(one, many, atol=1e-6, rtol=1e-6)


def test_last_split_merge_leaves_its_arrival_counters_at_zero_for_the_next_launch():
    q, k_cache, v_cache, tables, lens = _case([40, 9, 17], 4, 2, 2, 16, torch.float32, seed=4)
    first = decode_attention_launch(
        q, k_cache, v_cache, tables, lens, 0.3, 4, block_n=16, merge_in_kernel=True
    )
    assert not arrival_counters(q.device, 6).any()
    second = decode_attention_launch(
        q, k_cache, v_cache, tables, lens, 0.3, 4, block_n=16, merge_in_kernel=True
    )
    assert torch.equal(first, second)
    assert_close_to_float64(second, _expected(q, k_cache, v_cache, tables, lens, 0.3), torch.float32)


def test_decode_attention_rejects_query_heads_not_a_multiple_of_kv_heads():
    q, k_cache, v_cache, tables, lens = _case([4], 4, 2, 1, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        decode_attention_triton(
            q[:, :1].contiguous().expand(1, 3, 16).contiguous(), k_cache, v_cache, tables, lens, 1.0
        )
