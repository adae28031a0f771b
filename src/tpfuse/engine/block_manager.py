"""Paged KV blocks: allocation with reference counts, and a prefix cache over full blocks.

A full block whose KV has been computed is keyed by a chained hash (the previous block's hash and
this block's token ids), so equal prefixes share blocks across requests. A hit is confirmed by
comparing token ids, never by the hash alone. Freed blocks keep their content and key until they
are handed out again, oldest freed first, so recently used prefixes survive longest.
"""

from __future__ import annotations

from collections import OrderedDict

from tpfuse.engine.sequence import Sequence

NO_HASH = -1


def chain_hash(prev_hash: int, token_ids: list[int]) -> int:
    """Key of a full block: depends on every token before it through prev_hash."""
    return hash((prev_hash, tuple(token_ids)))


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids: tuple[int, ...] = ()


class BlockManager:
    """Owns num_blocks KV blocks of block_size tokens and assigns them to sequences.

    allocate() gives a sequence blocks for all its current tokens (reusing cached prefix blocks);
    append_slot() grows it as decoding adds tokens; seal_computed_blocks() registers newly full
    blocks in the prefix cache; free() drops the sequence's references.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # An ordered set, oldest first. Not a dict: taking a dict's first key after many deletions at
        # its front walks every deleted entry (quadratic over a run); OrderedDict's links do not.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens looked up."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def _cached_prefix(self, seq: Sequence) -> list[tuple[int, int]]:
        """(hash, block id) of the leading blocks found in the cache. Only blocks wholly inside
        token_ids[:-1] are looked up: the last token is always computed, as its logits are needed."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        prev = NO_HASH
        for i in range((len(seq) - 1) // self.block_size):
            ids = seq.block_token_ids(i)
            h = chain_hash(prev, ids)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tuple(ids):
                break
            hits.append((h, block_id))
            prev = h
        return hits

    def _num_new_blocks(self, seq: Sequence, hits: list[tuple[int, int]]) -> int:
        # A hit on a free block still takes it out of the free set, so only hits in use are free of cost.
        in_use = sum(1 for _, b in hits if self.blocks[b].ref_count > 0)
        return seq.num_blocks_for(len(seq)) - in_use

    def can_allocate(self, seq: Sequence, keep_free: int = 0) -> bool:
        """Whether seq's tokens fit with keep_free blocks left over (a reserve for others' growth)."""
        return self._num_new_blocks(seq, self._cached_prefix(seq)) + keep_free <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Gives seq blocks for all of its tokens; sets num_computed_tokens and num_cached_tokens to
        the cached prefix length. Raises RuntimeError when there are not enough free blocks."""
        if seq.block_table:
            raise RuntimeError(f"{seq} already holds blocks; free it before allocating again")
        hits = self._cached_prefix(seq)
        if self._num_new_blocks(seq, hits) > self.num_free_blocks:
            raise RuntimeError(f"not enough free KV blocks for {seq}; check can_allocate first")
        for h, block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
        for _ in range(seq.num_blocks_for(len(seq)) - len(hits)):
            seq.block_table.append(self._take_free_block())
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        # A drafter's KV in cached blocks was written by the sequence that computed them; only the
        # last cached position may differ (EAGLE-3 reads the token after it), so redo from there.
        seq.num_drafter_tokens = max(seq.num_cached_tokens - 1, 0)
        if self.enable_prefix_caching:
            self.num_queried_tokens += len(seq)
            self.num_hit_tokens += seq.num_cached_tokens

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash != NO_HASH and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids, block.ref_count = NO_HASH, (), 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Drops seq's references; blocks nobody uses become free (their prefix-cache entries stay)."""
        for block_id in reversed(seq.block_table):  # tail blocks are reused first
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        del seq.block_table[:]
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0
        seq.num_drafter_tokens = 0

    def may_append(self, seq: Sequence, num_lookahead_tokens: int = 0) -> bool:
        """Whether the blocks for all of seq's tokens (plus lookahead) can be provided now."""
        needed = seq.num_blocks_for(len(seq) + num_lookahead_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def append_slot(self, seq: Sequence, num_lookahead_tokens: int = 0) -> None:
        """Grows seq's block table to cover all its tokens (plus lookahead). Check may_append first."""
        needed = seq.num_blocks_for(len(seq) + num_lookahead_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"not enough free KV blocks to extend {seq}; check may_append first")
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def seal_computed_blocks(self, seq: Sequence) -> None:
        """Registers seq's blocks that became full and computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            ids = seq.block_token_ids(i)
            prev = seq.block_hashes[-1] if seq.block_hashes else NO_HASH
            h = chain_hash(prev, ids)
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids = h, tuple(ids)
            self.hash_to_block.setdefault(h, block.block_id)
            seq.block_hashes.append(h)
