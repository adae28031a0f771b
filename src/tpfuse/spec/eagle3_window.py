"""EAGLE-3 chain drafting of a pure decode step with fixed shapes, so it can live in a CUDA graph.

The eager drafter (eagle3_drafter.py) extends the head's KV over exactly the positions it lags
behind on, which varies per row and step. Here every row instead re-extends a fixed *window* of the
W = max_num_draft_tokens + 1 newest verified positions (a row lags by at most W after a chain step:
the accepted drafts plus the bonus token), then drafts k tokens. Re-extending a position the head
already holds recomputes the same entry from the same inputs (the target's features at p and the
verified token at p + 1), so the window changes no draft beyond rounding. With static buffers and
upper-bound launch sizes nothing reads the device from the host: the same code runs eagerly (CPU,
uncaptured sizes) and inside the target's verify graphs (engine/cuda_graphs.py).

Layout of a step's window section (spec_inputs.pack_spec_step with ext_window=W): row b's entries
are [b * W, (b + 1) * W), positions ascending and ending at the row's newest verified position;
padding rows have slot -1 (nothing is stored) and a draft budget of 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tpfuse.model.attention import AttentionMetadata
from tpfuse.spec.eagle3 import Eagle3Head


class Eagle3WindowDrafter:
    """Static-shape chain drafting for up to max_rows rows (the largest graph bucket).

    features: the engine's feature store ([slots + 1, H], last row spare, written by every target
    forward); kv_cache: the head's (k, v) indexed by the target's block tables; max_seq_len: an upper
    bound of any position + 1 the drafter attends to (launch sizes only).
    """

    def __init__(
        self,
        head: Eagle3Head,
        embed_tokens: Callable[[torch.Tensor], torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        features: torch.Tensor,
        block_size: int,
        max_rows: int,
        max_num_draft_tokens: int,
        max_seq_len: int,
    ):
        self.head = head
        self.embed_tokens = embed_tokens
        self.kv_cache = kv_cache
        self.features = features
        self.block_size = block_size
        self.max_rows = max_rows
        self.max_num_draft_tokens = max_num_draft_tokens
        self.window = w = max_num_draft_tokens + 1
        self.max_seq_len = max_seq_len
        device = features.device
        rows = torch.arange(max_rows + 1, device=device)
        # Capture-safe contents until the first load: positions 0..W-1, nothing stored, no drafts.
        self.positions = torch.arange(w, device=device).repeat(max_rows)
        self.next_ids = torch.zeros(max_rows * w, dtype=torch.int64, device=device)
        self.slots = torch.full((max_rows * w,), -1, dtype=torch.int64, device=device)
        self.draft_budget = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.window_starts = (rows * w).to(torch.int32)
        self.decode_starts = rows.to(torch.int32)
        self.last_entry = rows[:max_rows] * w + (w - 1)
        self.row_index = rows[:max_rows]
        self.drafts = torch.zeros(max_rows, max(max_num_draft_tokens, 1), dtype=torch.int64, device=device)

    def load(self, spec, num_rows: int) -> None:
        """Copies a step's window section (SpecInputs with header.ext_window == W, num_rows rows
        padding included) into the static buffers; each row's draft budget is its num_drafts."""
        if spec.header.ext_window != self.window or num_rows > self.max_rows:
            raise ValueError(
                f"window section of {num_rows} rows x {spec.header.ext_window} does not fit this drafter "
                f"({self.max_rows} rows x {self.window})"
            )
        n = num_rows * self.window
        self.positions[:n].copy_(spec.ext_positions)
        self.next_ids[:n].copy_(spec.ext_next_ids)
        self.slots[:n].copy_(spec.ext_slots)
        budget = self.draft_budget[:num_rows]
        budget.zero_()
        budget[: spec.header.num_decode].copy_(spec.num_drafts)

    def draft(self, num_rows: int, num_draft_tokens: int, block_tables: torch.Tensor) -> torch.Tensor:
        """Extends the window of the loaded rows and drafts num_draft_tokens per row, by argmax.

        block_tables: [num_rows, M] int32 (the target's). Returns drafts [num_rows, k] int64 in
        target ids, a view of a static buffer (valid until the next draft). Graph-safe.
        """
        head, w, bs = self.head, self.window, self.block_size
        n = num_rows * w
        positions, slots = self.positions[:n], self.slots[:n]
        last = self.last_entry[:num_rows]
        spare = self.features.shape[0] - 1
        attn = AttentionMetadata(
            slot_mapping=slots,
            block_tables=block_tables,
            seq_lens=(positions[last] + 1).to(torch.int32),
            query_start_loc=self.window_starts[: num_rows + 1],
            max_query_len=w,
            max_seq_len=self.max_seq_len,
            is_decode=False,
        )
        hidden = self.features.index_select(0, torch.where(slots < 0, spare, slots))
        normed, prenorm = head(self.embed_tokens(self.next_ids[:n]), hidden, positions, attn, self.kv_cache)
        drafts = self.drafts[:num_rows, :num_draft_tokens]
        if num_draft_tokens == 0:
            return drafts
        positions, normed, prenorm = positions[last], normed[last], prenorm[last]
        rows = self.row_index[:num_rows]
        last_column = block_tables.shape[1] - 1
        for step in range(num_draft_tokens):
            if step > 0:
                positions = positions + 1
                blocks = block_tables[rows, (positions // bs).clamp(max=last_column)].to(torch.int64)
                # a row stores draft entries only within its draft budget (padding rows: never)
                step_slots = torch.where(
                    step < self.draft_budget[:num_rows], blocks * bs + positions % bs, -1
                )
                attn = AttentionMetadata(
                    slot_mapping=step_slots,
                    block_tables=block_tables,
                    seq_lens=(positions + 1).to(torch.int32),
                    query_start_loc=self.decode_starts[: num_rows + 1],
                    max_query_len=1,
                    max_seq_len=self.max_seq_len,
                    is_decode=True,
                )
                normed, prenorm = head(
                    self.embed_tokens(drafts[:, step - 1]), prenorm, positions, attn, self.kv_cache
                )
            drafts[:, step] = head.to_target_ids(head.compute_logits(normed).argmax(dim=-1))
        return drafts
