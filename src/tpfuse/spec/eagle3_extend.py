"""The first pass of every EAGLE-3 drafting step, chain (eagle3_drafter.py) or tree (eagle3_tree.py):
the head extends its KV over the step's verified positions, pairing the target's features at p_j
with next_token_ids[j] (the pairing eagle3_drafter.py describes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tpfuse.spec.drafter import DraftInputs
from tpfuse.spec.eagle3 import Eagle3Head
from tpfuse.spec.paged import metadata_for_positions


def extend_verified(
    head: Eagle3Head,
    embed_tokens: Callable[[torch.Tensor], torch.Tensor],
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    inputs: DraftInputs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the head over the verified step (features at p_j, next_token_ids[j]), storing its KV at
    inputs.positions; chain and tree drafting both start here. Returns (normed, prenorm), each
    [T, H] for the step's T verified positions. Raises ValueError when inputs lacks block_tables, or
    both hidden_states and target_features."""
    inputs.require("block_tables", drafter="EAGLE-3")
    if inputs.hidden_states is None:
        inputs.require("target_features", drafter="EAGLE-3")
    attn = metadata_for_positions(
        inputs.block_tables,
        inputs.block_size,
        inputs.positions,
        inputs.query_start_loc,
        inputs.max_query_len,
        inputs.max_seq_len,
    )
    hidden = inputs.hidden_states
    if hidden is None:
        hidden = head.combine_features(inputs.target_features)
    return head(embed_tokens(inputs.next_token_ids), hidden, inputs.positions, attn, kv_cache)
