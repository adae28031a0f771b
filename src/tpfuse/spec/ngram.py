"""Prompt-lookup (n-gram) drafting: copy what followed the latest earlier occurrence of the suffix.

For each sequence, the last n tokens (n from max_ngram down to min_ngram) are searched for in the
sequence's own earlier tokens; at the most recent match, up to k tokens that followed it are
proposed. No model, no KV cache: it pays off on text that repeats its context (code edits,
summaries, extraction).
"""

from __future__ import annotations

import numpy as np
import torch

from tpfuse.spec.drafter import Drafter, DraftInputs, DraftProposal


def propose_ngram(
    tokens: list[int], num_draft_tokens: int, max_ngram: int = 4, min_ngram: int = 1
) -> list[int]:
    """Up to num_draft_tokens tokens to follow `tokens`, or [] when no suffix of length
    min_ngram..max_ngram occurs earlier. Longer suffixes win; among matches, the latest."""
    history = np.asarray(tokens, dtype=np.int64)
    length = len(history)
    if num_draft_tokens <= 0:
        return []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = history[length - n :]
        # Windows starting at 0..length-n-1: every occurrence that ends before the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(history[: length - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            follow = int(starts[-1]) + n
            return history[follow : follow + num_draft_tokens].tolist()
    return []


class NgramDrafter(Drafter):
    """Drafter over DraftInputs.token_histories (each sequence's tokens, the newest included)."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, inputs: DraftInputs, num_draft_tokens: int) -> DraftProposal:
        inputs.require("token_histories", drafter="n-gram")
        batch = len(inputs.token_histories)
        token_ids = torch.zeros(batch, num_draft_tokens, dtype=torch.int64)
        counts = torch.zeros(batch, dtype=torch.int64)
        for b, history in enumerate(inputs.token_histories):
            drafts = propose_ngram(history, num_draft_tokens, self.max_ngram, self.min_ngram)
            token_ids[b, : len(drafts)] = torch.tensor(drafts, dtype=torch.int64)
            counts[b] = len(drafts)
        device = inputs.positions.device
        return DraftProposal(token_ids.to(device), counts.to(device))
