"""BlockManager: allocation, reference counts, prefix hits on full blocks only, freeing."""

import pytest

from tpfuse.engine.block_manager import BlockManager
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.engine.sequence import Sequence

BLOCK = 4


def seq_of(tokens):
    return Sequence("r", list(tokens), SamplingParams(), BLOCK)


def computed(bm, seq):
    """Marks every token but the last as computed, as a finished prefill step would."""
    seq.num_computed_tokens = len(seq)
    bm.seal_computed_blocks(seq)
    return seq


def test_allocate_gives_one_block_per_block_size_tokens_rounded_up():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    seq = seq_of(range(9))
    bm.allocate(seq)
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5
    assert seq.num_computed_tokens == 0


def test_can_allocate_is_false_when_blocks_are_short_and_allocate_raises():
    bm = BlockManager(num_blocks=2, block_size=BLOCK)
    seq = seq_of(range(9))
    assert not bm.can_allocate(seq)
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        bm.allocate(seq)


def test_free_returns_every_block_and_resets_the_sequence():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    seq = seq_of(range(9))
    bm.allocate(seq)
    bm.free(seq)
    assert bm.num_free_blocks == 8
    assert len(seq.block_table) == 0 and seq.num_computed_tokens == 0
    assert bm.usage() == 0.0


def test_shared_prefix_reuses_full_blocks_and_counts_references():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    first = seq_of(range(10))
    bm.allocate(first)
    computed(bm, first)
    second = seq_of(list(range(8)) + [99, 98, 97])
    bm.allocate(second)
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] not in first.block_table
    assert second.num_cached_tokens == 8 and second.num_computed_tokens == 8
    assert [bm.blocks[b].ref_count for b in first.block_table[:2]] == [2, 2]
    bm.free(first)
    assert [bm.blocks[b].ref_count for b in second.block_table[:2]] == [1, 1]


def test_partial_blocks_are_never_prefix_hits():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    first = seq_of(range(7))  # one full block, one partial
    bm.allocate(first)
    computed(bm, first)
    second = seq_of(list(range(7)) + [50, 51])
    bm.allocate(second)
    assert second.num_cached_tokens == BLOCK
    assert second.block_table[1] != first.block_table[1]


def test_the_last_prompt_token_is_always_computed_even_when_every_block_is_cached():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    first = seq_of(range(8))
    bm.allocate(first)
    computed(bm, first)
    again = seq_of(range(8))
    bm.allocate(again)
    assert again.num_cached_tokens == BLOCK
    assert again.num_uncomputed_tokens == BLOCK


def test_prefix_hit_requires_equal_earlier_blocks_not_just_an_equal_block():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    first = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(first)
    computed(bm, first)
    other = seq_of([0, 0, 0, 0, 5, 6, 7, 8, 9])  # same second block, different first block
    bm.allocate(other)
    assert other.num_cached_tokens == 0


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_blocks=4, block_size=BLOCK)
    first = seq_of(range(9))
    bm.allocate(first)
    computed(bm, first)
    bm.free(first)
    again = seq_of(range(9))
    bm.allocate(again)
    assert again.num_cached_tokens == 8
    assert bm.hit_rate() == pytest.approx(8 / 18)


def test_reused_free_block_loses_its_prefix_cache_entry():
    bm = BlockManager(num_blocks=3, block_size=BLOCK)
    first = seq_of(range(9))
    bm.allocate(first)
    computed(bm, first)
    bm.free(first)
    filler = seq_of(range(100, 109))  # takes all three blocks, evicting the cached ones
    bm.allocate(filler)
    bm.free(filler)
    again = seq_of(range(9))
    bm.allocate(again)
    assert again.num_cached_tokens == 0


def test_hash_collision_is_rejected_by_comparing_token_ids(monkeypatch):
    import tpfuse.engine.block_manager as bm_module

    monkeypatch.setattr(bm_module, "chain_hash", lambda prev, ids: 7)
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    first = seq_of(range(9))
    bm.allocate(first)
    computed(bm, first)
    other = seq_of(range(20, 29))
    bm.allocate(other)
    assert other.num_cached_tokens == 0


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    first = seq_of(range(9))
    bm.allocate(first)
    computed(bm, first)
    again = seq_of(range(9))
    bm.allocate(again)
    assert again.num_cached_tokens == 0


def test_append_slot_adds_a_block_only_when_the_last_one_is_full():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    seq = seq_of(range(3))
    bm.allocate(seq)
    seq.append_token(3)
    assert bm.may_append(seq)
    bm.append_slot(seq)
    assert len(seq.block_table) == 1
    seq.append_token(4)
    bm.append_slot(seq)
    assert len(seq.block_table) == 2


def test_may_append_is_false_without_a_free_block_and_append_slot_raises():
    bm = BlockManager(num_blocks=1, block_size=BLOCK)
    seq = seq_of(range(4))
    bm.allocate(seq)
    seq.append_token(4)
    assert not bm.may_append(seq)
    with pytest.raises(RuntimeError, match="may_append"):
        bm.append_slot(seq)


def test_decoded_tokens_fill_blocks_that_become_prefix_hits():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    seq = seq_of(range(3))
    bm.allocate(seq)
    for t in range(3, 9):
        seq.num_computed_tokens = len(seq)
        bm.seal_computed_blocks(seq)
        seq.append_token(t)
        bm.append_slot(seq)
    seq.num_computed_tokens = len(seq)
    bm.seal_computed_blocks(seq)
    other = seq_of(list(range(9)) + [77])
    bm.allocate(other)
    assert other.num_cached_tokens == 8
