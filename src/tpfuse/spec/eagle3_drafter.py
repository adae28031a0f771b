"""Chain drafting with an EAGLE-3 head (top-k 1): extend the head's KV, then k autoregressive steps.

Pairing (as the head was trained): the entry at position p reads the target's features at p and the
token at p + 1 and predicts the token at p + 2. So a step's verified positions p_0..p_L are extended
with (features at p_j, next_token_ids[j]) and stored at p_j; the output at p_L gives draft 1 (for
position p_L + 2); draft i + 1 comes from the entry at p_L + i, which reads draft i and the previous
entry's pre-norm output in place of target features. Speculative entries (p_L + 1 ..) are overwritten
by the next step's extend, so rejected drafts need no rollback in the head's cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tpfuse.spec.draft_sampling import choose_draft_tokens
from tpfuse.spec.drafter import DraftInputs, DraftProposal, TreeDrafter
from tpfuse.spec.eagle3 import Eagle3Head
from tpfuse.spec.eagle3_extend import extend_verified
from tpfuse.spec.paged import decode_metadata

if TYPE_CHECKING:
    from tpfuse.spec.tree import DraftTree


def target_embedding(model) -> Callable[[torch.Tensor], torch.Tensor]:
    """Full embeddings from a tpfuse LlamaForCausalLM on every rank (its embedding returns per-rank
    partial sums under TP). Every rank must call it together."""
    return lambda ids: model.comm.all_reduce(model.embed_tokens(ids))


def eagle3_chain_draft(
    head: Eagle3Head,
    embed_tokens: Callable[[torch.Tensor], torch.Tensor],
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    inputs: DraftInputs,
    num_draft_tokens: int,
    target_vocab_size: int,
) -> DraftProposal:
    """Extends the head's KV with the verified step, then drafts num_draft_tokens tokens per sequence.

    embed_tokens: [N] int64 -> [N, H] full target embeddings; kv_cache: the head's (k, v), each
    head.kv_cache_shape(...), written at the verified positions and the drafted ones (the engine must
    have blocks up to p_L + num_draft_tokens - 1). inputs needs block_tables and target_features (or
    hidden_states, the features already through head.combine_features).
    Returns target-vocabulary draft ids [B, k]; with inputs.temperatures also their distributions
    [B, k, target_vocab_size] (draft-vocabulary probabilities scattered to target ids).
    """
    normed, prenorm = extend_verified(head, embed_tokens, kv_cache, inputs)
    tables, block_size = inputs.block_tables, inputs.block_size
    if num_draft_tokens == 0:
        return DraftProposal.empty(inputs.batch_size, inputs.positions.device)
    last = inputs.last_index()
    positions, normed, prenorm = inputs.positions[last], normed[last], prenorm[last]
    hot_ids = head.target_ids_of_draft_vocab() if inputs.temperatures is not None else None
    drafts, dists = [], []
    for step in range(num_draft_tokens):
        if step > 0:
            positions = positions + 1
            attn = decode_metadata(tables, block_size, positions, inputs.seq_len_bound(step))
            normed, prenorm = head(embed_tokens(drafts[-1]), prenorm, positions, attn, kv_cache)
        draft_ids, probs = choose_draft_tokens(
            head.compute_logits(normed), inputs.temperatures, inputs.seeds, step
        )
        drafts.append(head.to_target_ids(draft_ids))
        if probs is not None:
            dists.append(probs.new_zeros(probs.shape[0], target_vocab_size).index_copy_(1, hot_ids, probs))
    token_ids = torch.stack(drafts, dim=1)
    counts = torch.full((inputs.batch_size,), num_draft_tokens, dtype=torch.int64, device=token_ids.device)
    return DraftProposal(token_ids, counts, torch.stack(dists, dim=1) if dists else None)


class Eagle3Drafter(TreeDrafter):
    """An EAGLE-3 head behind the Drafter interface. embed_tokens: the target's full embedding
    (target_embedding(model)) unless the checkpoint shipped its own; kv_cache: the head's (k, v)."""

    def __init__(
        self,
        head: Eagle3Head,
        embed_tokens: Callable[[torch.Tensor], torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        target_vocab_size: int,
    ):
        self.head = head
        self.embed_tokens = head.embed_tokens if head.embed_tokens is not None else embed_tokens
        self.kv_cache = kv_cache
        self.target_vocab_size = target_vocab_size

    @torch.inference_mode()
    def propose_tree(self, inputs: DraftInputs, num_steps: int, topk: int, num_nodes: int) -> DraftTree:
        """Tree drafting (spec/eagle3_tree.py): a DraftTree of num_nodes nodes per sequence."""
        from tpfuse.spec.eagle3_tree import eagle3_tree_draft

        return eagle3_tree_draft(
            self.head, self.embed_tokens, self.kv_cache, inputs, num_steps, topk, num_nodes
        )

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs, num_draft_tokens: int) -> DraftProposal:
        return eagle3_chain_draft(
            self.head, self.embed_tokens, self.kv_cache, inputs, num_draft_tokens, self.target_vocab_size
        )
