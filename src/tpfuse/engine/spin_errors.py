"""The custom all-reduce kernels' spin-timeout error word, read without stalling the device.

A kernel whose peer never arrives within the spin timeout ORs that peer's bit into its rank's error
word and carries on with stale data (comm/sync.py). Every `interval_s` `SpinErrorWatch.poll` enqueues
a copy of the word into pinned memory behind the work in flight and reads the copy it enqueued the
time before once that copy has landed, so no poll waits for the device; a set bit raises
RuntimeError naming the ranks. Communicators without a workspace (gloo, NCCL) have nothing to watch.
"""

from __future__ import annotations

import time

import torch

from tpfuse.comm.sync import CTRL_ERROR


class SpinErrorWatch:
    def __init__(self, comm, rank: int, interval_s: float = 1.0):
        workspace = getattr(comm, "workspace", None)
        self.rank = rank
        self.interval_s = interval_s
        self.timeout_s = getattr(workspace, "timeout_s", 0.0)
        self.word = None if workspace is None else workspace.words[CTRL_ERROR.value : CTRL_ERROR.value + 1]
        self.cuda = self.word is not None and self.word.is_cuda
        self.host = (
            torch.zeros(1, dtype=self.word.dtype, pin_memory=self.cuda) if self.word is not None else None
        )
        self.event = torch.cuda.Event() if self.cuda else None
        self._pending = False
        self._last = time.monotonic()

    def poll(self) -> None:
        """Raises RuntimeError when a spin of this rank's kernels has timed out (seen by now)."""
        if self.word is None:
            return
        if self._pending and (not self.cuda or self.event.query()):
            self._pending = False
            mask = int(self.host[0]) & 0xFFFFFFFF
            if mask:
                missing = ", ".join(str(r) for r in range(mask.bit_length()) if mask >> r & 1)
                raise RuntimeError(
                    f"tensor-parallel rank {missing} never arrived in a tpfuse all-reduce of rank "
                    f"{self.rank} within {self.timeout_s:g} s (alive but stuck, or gone); its results "
                    "are stale, so the engine stops"
                )
        now = time.monotonic()
        if not self._pending and now - self._last >= self.interval_s:
            self._last = now
            self.host.copy_(self.word, non_blocking=self.cuda)
            if self.cuda:
                self.event.record()
            self._pending = True
