"""Prefill attention with a tree mask: each tree node sees the context and its own ancestors only."""

import pytest
import torch

from tests.kernels.paged import assert_close_to_float64, random_paged_kv
from tpfuse.kernels import prefill_attention_op
from tpfuse.kernels.paged_attention_common import _gather_kv
from tpfuse.kernels.prefill_attention import prefill_attention_launch, prefill_attention_ref


def _ancestor_bits(parents: list[int], context_bits: bool = True) -> list[int]:
    """Relative visibility bits of each node (parents[i] < i, -1 for the root): self, ancestors, and
    every position before the root (the context)."""
    out = []
    for i in range(len(parents)):
        bits, node = 0, i
        while node >= 0:
            bits |= 1 << (i - node)
            node = parents[node]
        bits |= ((1 << 64) - 1) ^ ((1 << (i + 1)) - 1)  # distances past the root: the context
        out.append(bits - (1 << 64) if bits >= 1 << 63 else bits)
    return out


def _dense_tree_reference(q, k_cache, v_cache, table, seq_len, parents, scale):
    """float64 per-node recomputation: keys = context positions + the node's ancestors (and itself)."""
    n_nodes = len(parents)
    context = seq_len - n_nodes
    group = q.shape[1] // k_cache.shape[2]
    k = _gather_kv(k_cache, table, seq_len).double().repeat_interleave(group, dim=1)
    v = _gather_kv(v_cache, table, seq_len).double().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(n_nodes):
        keep, node = list(range(context)), i
        while node >= 0:
            keep.append(context + node)
            node = parents[node]
        keys = torch.tensor(sorted(keep))
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k[keys]) * scale
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v[keys])
    return out


# Trees in topological order: a chain, a branching tree whose first child is not an ancestor of the
# deepest nodes, and a wide one (root with many children).
TREES = [[-1, 0, 1, 2], [-1, 0, 0, 1, 2, 2, 4], [-1, 0, 0, 0, 0, 1, 2, 3, 4]]


def _tree_batch(trees, contexts, block_size, group, head_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    seq_lens_list = [c + len(t) for c, t in zip(contexts, trees, strict=True)]
    k_cache, v_cache, tables, seq_lens = random_paged_kv(
        seq_lens_list, block_size, 2, head_dim, torch.float32, gen
    )
    q_lens = torch.tensor([len(t) for t in trees])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
    q = torch.randn(int(q_lens.sum()), 2 * group, head_dim, generator=gen)
    mask = torch.tensor([b for t in trees for b in _ancestor_bits(t)], dtype=torch.int64)
    return q, k_cache, v_cache, tables, seq_lens, starts, int(q_lens.max()), mask


def _expected(q, k_cache, v_cache, tables, seq_lens, starts, trees, scale):
    parts = []
    for b, parents in enumerate(trees):
        rows = slice(int(starts[b]), int(starts[b + 1]))
        parts.append(
            _dense_tree_reference(q[rows], k_cache, v_cache, tables[b], int(seq_lens[b]), parents, scale)
        )
    return torch.cat(parts)


def test_tree_mask_reference_equals_dense_float64_recomputation_with_only_ancestors_visible():
    q, kc, vc, tables, lens, starts, max_q, mask = _tree_batch(TREES, [13, 5, 22], 4, 2, 16, seed=1)
    out = prefill_attention_ref(q, kc, vc, tables, lens, starts, max_q, 0.3, mask)  # float32 inside
    assert_close_to_float64(out, _expected(q, kc, vc, tables, lens, starts, TREES, 0.3), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size,group,head_dim", [(4, 1, 16), (16, 2, 24)])
def test_triton_tree_mask_matches_dense_reference_at_odd_sizes(block_size, group, head_dim, num_splits):
    q, kc, vc, tables, lens, starts, max_q, mask = _tree_batch(
        TREES, [13, 5, 22], block_size, group, head_dim, 7
    )
    out = prefill_attention_launch(
        q, kc, vc, tables, lens, starts, max_q, 0.3, 16, 16, tree_mask=mask, num_splits=num_splits
    )
    expected = _expected(q, kc, vc, tables, lens, starts, TREES, 0.3)
    assert_close_to_float64(out, expected, torch.float32)


def test_tree_mask_of_all_ones_is_plain_causal_attention():
    q, kc, vc, tables, lens, starts, max_q, _ = _tree_batch(TREES, [13, 5, 22], 4, 2, 16, seed=3)
    ones = torch.full((q.shape[0],), -1, dtype=torch.int64)
    causal = prefill_attention_ref(q, kc, vc, tables, lens, starts, max_q, 0.3)
    torch.testing.assert_close(
        prefill_attention_ref(q, kc, vc, tables, lens, starts, max_q, 0.3, ones), causal
    )
    triton_out = prefill_attention_launch(q, kc, vc, tables, lens, starts, max_q, 0.3, 16, 16, tree_mask=ones)
    torch.testing.assert_close(triton_out, causal, atol=2e-5, rtol=2e-5)


def test_tree_mask_reaches_the_kernel_through_the_dispatching_op():
    q, kc, vc, tables, lens, starts, max_q, mask = _tree_batch(TREES[1:2], [9], 4, 1, 16, seed=4)
    out = prefill_attention_op(q, kc, vc, tables, lens, starts, max_q, 0.3, tree_mask=mask)
    expected = _expected(q, kc, vc, tables, lens, starts, TREES[1:2], 0.3)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
