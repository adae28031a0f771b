"""Drafting with a small model that shares the target's tokenizer (e.g. Llama 3.2 1B for 3.1 70B).

The draft model is any module with the target's seam: forward(input_ids, positions, attn, kv_caches)
-> (hidden, aux) and compute_logits(hidden) -> [N, vocab] float32 (a tpfuse LlamaForCausalLM). Its
paged KV holds one entry per position, like the target's. Each propose extends that cache with the
verified tokens plus the newest token (at the position after the last verified one), whose output
gives draft 1; drafts 2..k come from one-token decode passes. Entries written for drafts are
overwritten by the next extend, so rejected drafts need no rollback.
"""

from __future__ import annotations

import torch

from tpfuse.spec.draft_sampling import choose_draft_tokens
from tpfuse.spec.drafter import Drafter, DraftInputs, DraftProposal
from tpfuse.spec.paged import decode_metadata, metadata_for_positions


def _append_newest_token(inputs: DraftInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verified tokens of each sequence followed by its newest token, at consecutive positions.
    Returns (input_ids [T + B], positions [T + B], query_start_loc [B + 1] int32)."""
    batch, device = inputs.batch_size, inputs.positions.device
    lengths = (inputs.query_start_loc[1:] - inputs.query_start_loc[:-1]).to(torch.int64)
    num_tokens = inputs.positions.shape[0]
    seq_index = torch.repeat_interleave(torch.arange(batch, device=device), lengths, output_size=num_tokens)
    total = inputs.positions.shape[0] + batch
    shifted = torch.arange(inputs.positions.shape[0], device=device) + seq_index
    query_start_loc = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    query_start_loc[1:] = (lengths + 1).cumsum(0)
    ends = query_start_loc[1:].to(torch.int64) - 1
    last = inputs.last_index()
    ids = torch.empty(total, dtype=torch.int64, device=device)
    positions = torch.empty(total, dtype=torch.int64, device=device)
    ids[shifted], positions[shifted] = inputs.input_ids, inputs.positions
    ids[ends], positions[ends] = inputs.next_token_ids[last], inputs.positions[last] + 1
    return ids, positions, query_start_loc


class DraftModelDrafter(Drafter):
    """model: the draft model (see the module doc); kv_caches: its per-layer (k, v), indexed by
    DraftInputs.block_tables; vocab_size: the target's (draft logits past it are dropped)."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], vocab_size: int):
        self.model = model
        self.kv_caches = kv_caches
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs, num_draft_tokens: int) -> DraftProposal:
        """Needs input_ids, positions, next_token_ids, query_start_loc and block_tables; the
        engine must have blocks up to position p_L + num_draft_tokens for every sequence."""
        inputs.require("block_tables", drafter="draft-model")
        tables, block_size = inputs.block_tables, inputs.block_size
        ids, positions, query_start_loc = _append_newest_token(inputs)
        max_query_len = None if inputs.max_query_len is None else inputs.max_query_len + 1
        attn = metadata_for_positions(
            tables, block_size, positions, query_start_loc, max_query_len, inputs.seq_len_bound(1)
        )
        hidden, _ = self.model(ids, positions, attn, self.kv_caches)
        if num_draft_tokens == 0:
            return DraftProposal.empty(inputs.batch_size, positions.device)
        ends = query_start_loc[1:].to(torch.int64) - 1
        hidden, positions = hidden[ends], positions[ends]
        drafts, dists = [], []
        for step in range(num_draft_tokens):
            if step > 0:
                positions = positions + 1
                attn = decode_metadata(tables, block_size, positions, inputs.seq_len_bound(step + 1))
                hidden, _ = self.model(drafts[-1], positions, attn, self.kv_caches)
            logits = self.model.compute_logits(hidden)[:, : self.vocab_size]
            token, probs = choose_draft_tokens(logits, inputs.temperatures, inputs.seeds, step)
            drafts.append(token)
            if probs is not None:
                dists.append(probs)
        token_ids = torch.stack(drafts, dim=1)
        counts = torch.full(
            (inputs.batch_size,), num_draft_tokens, dtype=torch.int64, device=token_ids.device
        )
        return DraftProposal(token_ids, counts, torch.stack(dists, dim=1) if dists else None)
