"""Rank 0 -> worker ranks: each step's packed inputs through one shared-memory tensor.

Layout (int64): [sequence number, payload length, step kind, ack of rank 1 .. ack of rank N-1,
done of rank 1 .. done of rank N-1, payload ...]. Rank 0 waits until every worker has acknowledged the
previous step, writes the payload, the kind and the length, then bumps the sequence number; a worker
spins on the sequence number (sleeping once idle), copies the payload out and acknowledges, and
marks the step done once it has run it (host side: launched), which tells rank 0 a stuck rank.
The sequence number is written last, and x86-64 keeps the order of stores as other cores see it,
so a worker never reads a half-written payload.
A negative length asks the workers to exit.
"""

from __future__ import annotations

import contextlib
import time

import torch

IDLE_POLL_S = 0.0002


class StepChannel:
    """Shared between the engine process (rank 0) and tp_size - 1 worker processes.

    capacity: the largest payload in int64 elements; send() raises ValueError past it.
    spin_s: how long a worker busy-polls after its last step before it polls every IDLE_POLL_S
    (GPU ranks spin for latency; CPU ranks must not, they would take cores from the forward).
    """

    def __init__(self, tp_size: int, capacity: int, spin_s: float = 0.5):
        self.num_workers = tp_size - 1
        self.spin_s = spin_s
        self.header = 3 + 2 * self.num_workers
        self.buffer = torch.zeros(self.header + capacity, dtype=torch.int64).share_memory_()
        self._init_views()

    def _init_views(self):
        self._array = self.buffer.numpy()
        self._sent = 0

    def __getstate__(self):
        return {k: self.__dict__[k] for k in ("num_workers", "spin_s", "header", "buffer")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_views()

    @property
    def capacity(self) -> int:
        return self.buffer.numel() - self.header

    def send(self, packed: torch.Tensor, kind: int = 0, is_alive=lambda: True, prefix=()) -> None:
        """Rank 0: publishes prefix (a few ints) followed by packed (CPU int64), with a step kind (both
        the worker's business). Waits for every worker to have taken the previous step; is_alive() ->
        False aborts the wait with RuntimeError (a worker died)."""
        m = len(prefix)
        n = m + packed.numel()
        if n > self.capacity:
            raise ValueError(
                f"a step of {n} values exceeds the worker channel ({self.capacity}); lower "
                "--max-num-batched-tokens or --max-running-requests"
            )
        self._wait_for_acks(is_alive)
        if m:
            self._array[self.header : self.header + m] = prefix
        self.buffer[self.header + m : self.header + n].copy_(packed)
        self._array[2] = kind
        self._publish(n)

    def send_shutdown(self, timeout_s: float = 5.0) -> None:
        """Asks the workers to exit once they have taken the last step (waits up to timeout_s for that)."""
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(RuntimeError):  # a gone or stuck worker is killed by the executor
            self._wait_for_acks(lambda: time.monotonic() < deadline)
        self._publish(-1)

    def _publish(self, length: int) -> None:
        self._sent += 1
        self._array[1] = length
        self._array[0] = self._sent

    def _wait_for_acks(self, is_alive) -> None:
        acks = self._array[3 : 3 + self.num_workers]
        checked = time.monotonic()
        while (acks != self._sent).any():
            now = time.monotonic()
            if now - checked > 0.1:
                checked = now
                if not is_alive():
                    raise RuntimeError("a tensor-parallel worker stopped taking steps (it exited or hangs)")

    @property
    def sent(self) -> int:
        """Rank 0: the number of the newest published step."""
        return self._sent

    def lagging(self) -> list[int]:
        """Rank 0: the worker ranks that have not yet run the newest published step."""
        done = self._array[3 + self.num_workers : self.header]
        return [rank for rank in range(1, self.num_workers + 1) if done[rank - 1] < self._sent]

    def mark_done(self, rank: int, number: int) -> None:
        """Worker `rank`: step `number` has run (its work is enqueued on the device)."""
        self._array[2 + self.num_workers + rank] = number

    def receive(self, rank: int, last: int) -> tuple[int, int, torch.Tensor | None]:
        """Worker `rank`: waits for a step newer than `last`; returns (its number, its kind, a private
        copy of its payload), or (number, kind, None) for shutdown. Acknowledges before returning."""
        idle_since = time.monotonic()
        while self._array[0] == last:
            if time.monotonic() - idle_since > self.spin_s:
                time.sleep(IDLE_POLL_S)
        number = int(self._array[0])
        length = int(self._array[1])
        kind = int(self._array[2])
        payload = None if length < 0 else self.buffer[self.header : self.header + length].clone()
        self._array[2 + rank] = number
        return number, kind, payload
