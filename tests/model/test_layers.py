"""Tensor-parallel layers, checked rank by rank in one process: each rank's shard, combined the
way the Communicator would combine it, equals the unsharded float64 computation."""

from __future__ import annotations

import pytest
import torch

from tests.model.harness import PagedSequences
from tpfuse.comm.communicator import SingleRankCommunicator
from tpfuse.config import EngineConfig
from tpfuse.model.layers import (
    ColumnParallelLinear,
    ParallelContext,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tpfuse.model.loader import load_model

DTYPE = torch.float64


def ranks(tp_size: int) -> list[ParallelContext]:
    return [ParallelContext(r, tp_size, SingleRankCommunicator()) for r in range(tp_size)]


def fill(slot, full: torch.Tensor) -> None:
    slot.destination().copy_(full[slot.source_index()])


def test_row_parallel_partial_sums_add_up_to_the_full_product():
    weight, x = torch.randn(6, 12, dtype=DTYPE), torch.randn(3, 12, dtype=DTYPE)
    total = torch.zeros(3, 6, dtype=DTYPE)
    for ctx in ranks(3):
        layer = RowParallelLinear(12, 6, ctx, DTYPE)
        fill(layer.slot(), weight)
        total += layer(x[:, layer.start : layer.start + layer.local_input])
    torch.testing.assert_close(total, x @ weight.T)


def test_merged_gate_up_shards_each_part_separately():
    gate, up, x = (
        torch.randn(8, 5, dtype=DTYPE),
        torch.randn(8, 5, dtype=DTYPE),
        torch.randn(2, 5, dtype=DTYPE),
    )
    for ctx in ranks(2):
        layer = ColumnParallelLinear(5, [8, 8], ctx, DTYPE)
        fill(layer.slot(0), gate)
        fill(layer.slot(1), up)
        rows = slice(4 * ctx.tp_rank, 4 * ctx.tp_rank + 4)
        torch.testing.assert_close(layer(x), torch.cat([x @ gate[rows].T, x @ up[rows].T], dim=-1))


@pytest.mark.parametrize(("num_kv_heads", "expected_kv_heads"), [(4, [[0, 1], [2, 3]]), (1, [[0], [0]])])
def test_qkv_shard_holds_its_query_heads_and_the_kv_heads_they_use(num_kv_heads, expected_kv_heads):
    head_dim, num_heads = 2, 4
    q = torch.randn(num_heads * head_dim, 3, dtype=DTYPE)
    kv = [torch.randn(num_kv_heads * head_dim, 3, dtype=DTYPE) for _ in range(2)]
    for ctx in ranks(2):
        layer = QKVParallelLinear(3, head_dim, num_heads, num_kv_heads, ctx, DTYPE)
        for part, full in enumerate([q, *kv]):
            fill(layer.slot(part), full)
        q_rows = q[4 * ctx.tp_rank : 4 * ctx.tp_rank + 4]
        kv_rows = [
            full.view(num_kv_heads, head_dim, 3)[expected_kv_heads[ctx.tp_rank]].flatten(0, 1) for full in kv
        ]
        torch.testing.assert_close(layer.weight, torch.cat([q_rows, *kv_rows]))


def test_vocab_parallel_embedding_partials_sum_to_the_full_embedding_with_padding():
    vocab, hidden = 11, 4  # 3 ranks of 4 rows: the last holds 3 real rows and one zero padding row
    table, ids = torch.randn(vocab, hidden, dtype=DTYPE), torch.tensor([0, 3, 4, 7, 8, 10])
    total = torch.zeros(len(ids), hidden, dtype=DTYPE)
    for ctx in ranks(3):
        layer = VocabParallelEmbedding(vocab, hidden, ctx, DTYPE)
        fill(layer.slot(), table)
        partial = layer(ids)
        outside = (ids < layer.start) | (ids >= layer.start + layer.rows_per_rank)
        assert partial[outside].eq(0).all()
        total += partial
    torch.testing.assert_close(total, table[ids])
    assert layer.weight[-1].eq(0).all()


def test_lm_head_gathers_the_full_vocabulary_from_padded_shards():
    vocab, hidden = 11, 4
    table, hidden_states = torch.randn(vocab, hidden, dtype=DTYPE), torch.randn(2, hidden, dtype=DTYPE)
    shards = []
    for ctx in ranks(3):
        head = ParallelLMHead(vocab, hidden, ctx, DTYPE)
        fill(head.slot(), table)
        shards.append(hidden_states @ head.weight.T)
    torch.testing.assert_close(torch.cat(shards, dim=-1)[:, :vocab], hidden_states @ table.T)


def test_lm_head_writes_into_a_given_buffer_what_it_returns_without_one():
    """The CUDA graphs hand the shared float32 logits buffer in (no extra copy): same values."""
    head = ParallelLMHead(13, 8, ranks(1)[0], torch.bfloat16)
    head.weight.data.normal_()
    hidden = torch.randn(3, 8).bfloat16()
    out = torch.full((3, 13), float("nan"))
    assert head(hidden, out) is out
    assert torch.equal(out, head(hidden)) and head(hidden).dtype == torch.float32


def test_tied_lm_head_shares_the_embedding_weight():
    ctx = ranks(1)[0]
    embedding = VocabParallelEmbedding(10, 4, ctx, DTYPE)
    assert ParallelLMHead(10, 4, ctx, DTYPE, tied_to=embedding).weight is embedding.weight


class CountingCommunicator(SingleRankCommunicator):
    def __init__(self):
        self.calls = {"fused": 0, "all_reduce": 0, "all_gather": 0}

    def all_reduce(self, x):
        self.calls["all_reduce"] += 1
        return super().all_reduce(x)

    def fused_add_rmsnorm_all_reduce(self, x, residual, weight, eps):
        self.calls["fused"] += 1
        return super().fused_add_rmsnorm_all_reduce(x, residual, weight, eps)


def test_forward_crosses_ranks_only_through_2n_plus_1_fused_ops():
    comm = CountingCommunicator()
    model, config = load_model(EngineConfig(model="tiny"), ParallelContext(0, 1, comm), "cpu")
    PagedSequences(model, 2).step([[1, 2, 3], [4, 5]])
    assert comm.calls == {"fused": 2 * config.num_layers + 1, "all_reduce": 0, "all_gather": 0}


def test_dummy_weights_are_seeded_and_finite():
    load = lambda seed: load_model(EngineConfig(model="tiny", seed=seed), ranks(1)[0], "cpu")[0]
    a, b, c = load(0), load(0), load(1)
    logits = [PagedSequences(m, 1).step([[1, 2, 3]])[0] for m in (a, b, c)]
    assert torch.isfinite(logits[0]).all()
    assert torch.equal(logits[0], logits[1]) and not torch.equal(logits[0], logits[2])
