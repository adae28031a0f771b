"""Chained speculative steps: the next EAGLE-3 window step is launched before this one is read.

A speculative step's successor depends on how many drafts it accepted (a = 0..k per row), which the
host learns only when the step's results come back. Waiting for them leaves the GPU idle while the
host reads the result, packs the next step, copies it and launches its graph. Instead, while step N
runs, the host packs a *template* of step N + 1 as if every row accepted no draft (each sequence one
token longer, its newest id unknown: TEMPLATE_TOKEN), and the device shifts that template by the
accepted counts of step N before the replay (`shift_by_accepted`):

- every position (verify rows and drafter window) moves by a, and its KV slot is looked up again in
  the block table (the scheduler reserved blocks for the largest shift, schedule_next_spec_decode);
- the window's ids, its next-token ids and the verify row's newest id are read from the W ids the
  host knew at the window's positions, followed by the tokens step N emitted;
- the context lengths and output indices move by a.

Everything else in the template does not depend on a, given the conditions the engine chains under
(the same decode rows in the same order, greedy verification or simulated acceptance, no min_tokens
ban left, room for the full k whatever step N accepts). So a chained step computes exactly what the
synchronous path would have packed. If a request finishes or is aborted meanwhile, the launched
step still runs for the others and that row's tokens are discarded (its KV writes lie past the
sequence's computed positions), and the step chained after it leaves that row out: its template
rows take their shifts from the rows they continue (ChainLink). A request that arrives joins the
first step scheduled after it. At TP > 1 every rank verifies the step in flight itself
(spec_verify.py) and shifts by its own result; rank 0 sends only the rows.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import torch

from tpfuse.engine.batch import Batch
from tpfuse.engine.sequence import Sequence
from tpfuse.engine.spec_inputs import SpecInputs
from tpfuse.engine.step_inputs import StepInputs
from tpfuse.spec.verify import VerifyResult

TEMPLATE_TOKEN = 0  # the placeholder of each row's newest id in a template; the device replaces it


class _WithOneMore(SequenceABC):
    """A read-only view of token ids with one placeholder appended (no copy of the ids)."""

    def __init__(self, ids: list[int]):
        self._ids = ids

    def __len__(self) -> int:
        return len(self._ids) + 1

    def __getitem__(self, index):
        n = len(self._ids)
        if isinstance(index, slice):
            start, stop, step = index.indices(n + 1)
            if step != 1:
                raise ValueError("a template's ids support contiguous slices only")
            return self._ids[start:stop] + ([TEMPLATE_TOKEN] if stop > n >= start else [])
        position = index + n + 1 if index < 0 else index
        if not 0 <= position <= n:
            raise IndexError(f"token index {index} is outside a template of {n + 1} ids")
        return TEMPLATE_TOKEN if position == n else self._ids[position]


class _AfterOneToken:
    """A decode sequence as the next step sees it if the step in flight emits one token: one id
    longer (a placeholder) and one position further computed; the drafter needs only the window."""

    def __init__(self, seq: Sequence):
        self.seq_id = seq.seq_id
        self.params = seq.params
        self.block_table = seq.block_table
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.token_ids = _WithOneMore(seq.token_ids)
        self.num_computed_tokens = seq.num_computed_tokens + 1
        self.num_drafter_tokens = seq.num_computed_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def template_batch(batch: Batch) -> Batch:
    """The batch to pack for the step after `batch` (all decode rows) while `batch` runs."""
    return Batch([_AfterOneToken(seq) for seq in batch.seqs], list(batch.num_new_tokens))


@dataclass
class ChainLink:
    """What a chained template needs of the step in flight before it: that step's verify result, its
    k, and the rows of it each template row continues (None: all of them, in order)."""

    result: VerifyResult
    num_draft_tokens: int
    rows: list[int] | None

    def shift(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(accepted [D], emitted [D, k'+1], k') for the template's rows, on the device."""
        accepted, emitted = self.result.num_accepted, self.result.token_ids
        if self.rows is not None:
            index = torch.tensor(self.rows)
            if accepted.is_cuda:  # pinned: the copy must not wait for the step in flight
                index = index.pin_memory().to(accepted.device, non_blocking=True)
            accepted, emitted = accepted[index], emitted[index]
        return accepted, emitted, self.num_draft_tokens


def continued_rows(before: Batch, batch: Batch) -> list[int] | None:
    """The row of before that each row of batch continues (batch's rows are before's rows in order,
    less those that finished while before ran); None when batch keeps them all."""
    if len(batch.seqs) == len(before.seqs):
        return None
    row_of = {id(seq): row for row, seq in enumerate(before.seqs)}
    return [row_of[id(seq)] for seq in batch.seqs]


def continued_results(before: Batch, batch: Batch, result) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [D], emitted [D, k'+1]) of the step before, on the device, for the rows of batch."""
    accepted, emitted, _ = ChainLink(result, 0, continued_rows(before, batch)).shift()
    return accepted, emitted


def _lookup_slots(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """KV slots of positions [D, n] in the rows' block tables [D, M]."""
    blocks = block_tables.gather(1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


@torch.inference_mode()
def shift_by_accepted(
    step: StepInputs,
    spec: SpecInputs,
    num_accepted: torch.Tensor,
    emitted: torch.Tensor,
    block_size: int,
    max_shift: int,
) -> None:
    """Turns the device copy of a template (template_batch, packed as a window step) into the step
    that follows one whose decode rows accepted num_accepted [D] drafts and emitted emitted [D, k'+1]
    (the accepted drafts, then the target's token; -1 after it). In place, on the device, without
    reading anything back. max_shift: the most drafts the step before could accept (the host launch
    bounds grow by it). Padding rows (after the D decode rows) keep their template values."""
    h = spec.header
    rows, d, k, w = step.header.num_seqs, h.num_decode, h.num_draft_tokens, h.ext_window
    if not (h.pure_decode and w and num_accepted.shape[0] == d):
        raise ValueError("only a window step of the same decode rows can follow a step in flight")
    a = num_accepted[:, None]
    tables = step.block_tables[:d]
    # Each row's ids from the template window's first position on: the W ids the host knew, then
    # what was emitted. The shifted window starts a positions later.
    window_ids, window_next = (x.view(rows, w)[:d] for x in (spec.ext_input_ids, spec.ext_next_ids))
    known = torch.cat([window_ids[:, :1], window_next[:, : w - 1], emitted], dim=1)
    columns = a + torch.arange(w, device=a.device)
    window_ids.copy_(known.gather(1, columns))
    window_next.copy_(known.gather(1, columns + 1))
    verify = slice(0, d * (k + 1))
    step.input_ids[verify].view(d, k + 1)[:, 0] = window_next[:, w - 1]
    for positions, slots in (
        (step.positions[verify].view(d, k + 1), step.slot_mapping[verify].view(d, k + 1)),
        (spec.ext_positions.view(rows, w)[:d], spec.ext_slots.view(rows, w)[:d]),
    ):
        positions.add_(a)
        slots.copy_(torch.where(slots < 0, slots, _lookup_slots(tables, positions, block_size)))
    step.seq_lens[:d].add_(num_accepted)
    spec.output_index.add_(num_accepted)
    step.header.max_seq_len += max_shift
    h.ext_max_seq_len += max_shift
