"""Sampled token ids from the device to Python: a step's ids start their copy into pinned memory as
soon as they are enqueued (`start`), and the host waits for them only when it needs them (`wait`).

Two pinned buffers alternate, so the copy of step N + 1 can be enqueued before the host has read
step N's ids (the overlap schedule keeps at most one step in flight past the one being read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PendingStep:
    """A launched step whose ids are on their way to the host.

    tokens: device ids [R] (by_row: one per batch row, padding rows after them) or [N] in the order
    of the sampling rows; None when no row samples. rows: the batch rows that sample.
    """

    tokens: torch.Tensor | None
    rows: list[int]
    by_row: bool
    num_rows: int
    host: torch.Tensor | None = None
    event: object = None


class TokenReadback:
    """Device-to-host copies of sampled ids through alternating pinned buffers (CUDA), or plain
    reads (CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if self.cuda else [None, None]
        self._next = 0

    def start(self, tokens: torch.Tensor | None, rows: list[int], by_row: bool, num_rows: int) -> PendingStep:
        """Enqueues the copy of tokens [R] int64 (see PendingStep) and returns without waiting."""
        pending = PendingStep(tokens, rows, by_row, num_rows)
        if tokens is None:
            return pending
        if not self.cuda:  # the copy is taken now, as on the device (a later step may reuse tokens)
            pending.host = tokens.clone()
            return pending
        i, n = self._next, tokens.numel()
        self._next ^= 1
        if self._buffers[i] is None or self._buffers[i].numel() < n:
            self._buffers[i] = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=True)
        pending.host = self._buffers[i][:n]
        pending.host.copy_(tokens, non_blocking=True)
        pending.event = self._events[i]
        pending.event.record()
        return pending

    def to_list(self, tokens: torch.Tensor) -> list[int]:
        """tokens [N] as Python ints (waits for them)."""
        pending = self.start(tokens, list(range(tokens.numel())), False, tokens.numel())
        return self.read(pending)

    def read(self, pending: PendingStep) -> list[int]:
        """All values of a started copy as Python ints (waits for them)."""
        if pending.event is not None:
            pending.event.synchronize()
        return pending.host.tolist()

    def wait(self, pending: PendingStep) -> list[int | None]:
        """One entry per batch row: its sampled id, or None for a row that did not sample."""
        out: list[int | None] = [None] * pending.num_rows
        if pending.tokens is None:
            return out
        values = self.read(pending)
        if pending.by_row:
            for row in pending.rows:
                out[row] = values[row]
        else:
            for row, value in zip(pending.rows, values, strict=True):
                out[row] = value
        return out
