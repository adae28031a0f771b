"""Rank 0's part of a tree speculative step: verify the tree, and move the accepted path's KV.

`verify_tree` masks the banned (row, node) pairs and verifies each row's draft tree (greedy,
rejection sampling, or seeded for seeded requests, so their tokens do not depend on the tree).
The accepted path's nodes sit at tree positions, not at consecutive ones: `TreeKvMoves` records
(src, dst) positions of each row's accepted path and hands the next step of that sequence the
slot pairs to copy first, so its KV lies where its length says.
"""

from __future__ import annotations

import torch

from tpfuse.engine.batch import Batch
from tpfuse.engine.spec_rows import is_decode_row
from tpfuse.spec.tree_verify import (
    TreeVerifyResult,
    greedy_tree_verify,
    rejection_tree_verify,
    seeded_tree_verify,
)


@torch.inference_mode()
def verify_tree(
    forward, batch: Batch, decode_rows: list[int], any_seeded: bool, max_depth: int
) -> tuple[TreeVerifyResult, torch.Tensor]:
    """(result, depth limit per row [D]) of a tree step's verify rows; forward: its SpecForward."""
    spec, logits, tree = forward.spec, forward.verify_logits, forward.proposal
    depth_limit = spec.num_drafts
    if spec.header.num_banned:
        n = tree.num_nodes
        rows, nodes = spec.banned_rows // n, spec.banned_rows % n
        remaining = torch.tensor(
            [batch.bans[r].count if r in batch.bans else 0 for r in decode_rows],
            device=logits.device,
        )
        keep = tree.depths[rows, nodes] < remaining[rows]
        logits.view(-1, logits.shape[-1])[spec.banned_rows[keep], spec.banned_ids[keep]] = float("-inf")
    if spec.header.all_greedy:
        return greedy_tree_verify(tree, logits, depth_limit, max_depth), depth_limit
    sampling = (spec.temperatures, spec.top_ks, spec.top_ps)
    result = rejection_tree_verify(tree, logits, *sampling, spec.seeds, depth_limit, max_depth)
    if any_seeded:
        seeded = seeded_tree_verify(
            tree, logits, *sampling, spec.request_seeds, spec.output_index, depth_limit, max_depth
        )
        use = spec.seeded.bool()[:, None]
        result = TreeVerifyResult(
            torch.where(use[:, 0], seeded.num_accepted, result.num_accepted),
            torch.where(use, seeded.token_ids, result.token_ids),
            torch.where(use, seeded.path_nodes, result.path_nodes),
        )
    return result, depth_limit


class TreeKvMoves:
    """The KV moves the accepted tree paths owe, per sequence, until its next decode step."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.pending: dict[int, tuple] = {}  # seq_id -> (seq, num_computed, [(src, dst) positions])

    def take(self, batch: Batch) -> list[tuple[int, int]]:
        """(src, dst) slots of the last tree step's accepted paths, for sequences that come back as
        decodes right after it; a sequence seen in any other state (prefill: recomputed after
        preemption) drops its moves."""
        moves = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            entry = self.pending.pop(seq.seq_id, None)
            if entry is None or not is_decode_row(seq, n) or seq.num_computed_tokens != entry[1]:
                continue
            table, bs = seq.block_table, self.block_size
            moves += [(table[s // bs] * bs + s % bs, table[d // bs] * bs + d % bs) for s, d in entry[2]]
        for seq_id in [i for i, e in self.pending.items() if e[0].is_finished]:
            del self.pending[seq_id]
        return moves

    def record(self, batch: Batch, decode_rows: list[int], path_nodes, accepted: list[int]) -> None:
        """Records the moves of each verify row's accepted path (path_nodes [D, depth + 1])."""
        paths = path_nodes.tolist()
        for row, path, a in zip(decode_rows, paths, accepted, strict=True):
            seq = batch.seqs[row]
            root = seq.num_computed_tokens
            moves = [(root + path[d], root + d) for d in range(1, a + 1) if path[d] != d]
            if moves:
                self.pending[seq.seq_id] = (seq, root + a + 1, moves)
