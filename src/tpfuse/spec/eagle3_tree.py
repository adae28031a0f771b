"""Tree drafting with an EAGLE-3 head (top-k > 1), see spec/tree.py for the tree's shape.

The head first extends its KV over the verified positions exactly as chain drafting does (its last
entry, at the newest verified position p, gives the root's children). Depth t >= 2 runs one pass over
the k frontier nodes of depth t - 1: each is an entry reading its token and its parent entry's
pre-norm output, at rotary position p + t - 1, stored at the temporary head slot p + 1 + k (t - 2) + f,
and attending (tree mask) to the context and its own ancestor entries only. Those temporary entries
lie past the verified positions, so the next step's extend overwrites them: no rollback.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tpfuse.model.attention import AttentionMetadata
from tpfuse.spec.drafter import DraftInputs
from tpfuse.spec.eagle3 import Eagle3Head
from tpfuse.spec.eagle3_extend import extend_verified
from tpfuse.spec.paged import slots_of_positions
from tpfuse.spec.tree import DraftTree, TreeCandidates, ancestor_matrix, tree_attention_bits


def _frontier_metadata(
    inputs: DraftInputs, newest: torch.Tensor, entry_parents: torch.Tensor, topk: int
) -> AttentionMetadata:
    """Metadata for the last topk entries of each sequence; entry_parents: [B, M] (0: the newest
    verified position, j: entry j - 1) for all M entries so far, the last topk being queried."""
    batch, m = entry_parents.shape
    device = newest.device
    parents = torch.cat([torch.full((batch, 1), -1, dtype=torch.int64, device=device), entry_parents], 1)
    bits = tree_attention_bits(ancestor_matrix(parents, m)).view(batch, m + 1)[:, -topk:]
    seq_index = torch.arange(batch, device=device).repeat_interleave(topk)
    slot_positions = (newest[:, None] + m - topk + 1 + torch.arange(topk, device=device)).reshape(-1)
    return AttentionMetadata(
        slot_mapping=slots_of_positions(inputs.block_tables, inputs.block_size, seq_index, slot_positions),
        block_tables=inputs.block_tables,
        seq_lens=(newest + m + 1).to(torch.int32),
        query_start_loc=(torch.arange(batch + 1, device=device) * topk).to(torch.int32),
        max_query_len=topk,
        max_seq_len=inputs.seq_len_bound(m) or int(newest.max()) + m + 1,
        is_decode=False,
        tree_mask=bits.reshape(-1),
    )


def eagle3_tree_draft(
    head: Eagle3Head,
    embed_tokens: Callable[[torch.Tensor], torch.Tensor],
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    inputs: DraftInputs,
    num_steps: int,
    topk: int,
    num_draft_tokens: int,
) -> DraftTree:
    """Extends the head's KV with the verified step, then drafts a tree of num_draft_tokens nodes per
    sequence (root = the newest token, next_token_ids' last entry). The engine must have head KV blocks
    up to p + topk * (num_steps - 1). Returns the DraftTree (target-vocabulary ids)."""
    normed, prenorm = extend_verified(head, embed_tokens, kv_cache, inputs)
    last = inputs.last_index()
    newest, normed, prenorm = inputs.positions[last], normed[last], prenorm[last]
    batch, width = prenorm.shape
    candidates = TreeCandidates(topk)
    chosen = candidates.add_depth(head.compute_logits(normed).log_softmax(-1)[:, None], head.to_target_ids)
    parent_state = prenorm[:, None].expand(batch, topk, width)
    entry_parents = torch.zeros(batch, topk, dtype=torch.int64, device=newest.device)
    for depth in range(2, num_steps + 1):
        tokens = candidates.frontier_tokens().reshape(-1)
        positions = (newest + depth - 1).repeat_interleave(topk)
        attn = _frontier_metadata(inputs, newest, entry_parents, topk)
        normed, prenorm = head(
            embed_tokens(tokens), parent_state.reshape(-1, width), positions, attn, kv_cache
        )
        logprobs = head.compute_logits(normed).log_softmax(-1).view(batch, topk, -1)
        chosen = candidates.add_depth(logprobs, head.to_target_ids)
        parent_frontier = chosen // topk  # which of this pass's entries each new frontier node hangs off
        parent_state = prenorm.view(batch, topk, width).gather(
            1, parent_frontier[..., None].expand(-1, -1, width)
        )
        first_entry = entry_parents.shape[1] - topk + 1  # this pass's entries, as tree nodes (0: newest)
        entry_parents = torch.cat([entry_parents, parent_frontier + first_entry], 1)
    tree = candidates.select(num_draft_tokens)
    tree.token_ids[:, 0] = inputs.next_token_ids[last]
    return tree
