"""L2Prefetcher: pull the next projection's weight into L2 while latency-bound kernels run.

At small batch a decoder layer's attention part (rotary + KV store, decode attention) takes a few
microseconds during which HBM sits idle, and the o_proj GEMV that follows is too short to reach full
bandwidth from HBM. The prefetcher forks a side stream after the qkv projection, reads o_proj's
weight there (kernels/l2_prefetch.py) and joins the side stream back before the forward returns, so
the o_proj GEMV finds most of its weight in L2. It never changes a value: the weights are read-only
and the o_proj kernel does not wait for the prefetch (a line not yet fetched is read from HBM).

Works inside CUDA-graph capture (the fork and join become graph edges). Enabled on CUDA when
`TPFUSE_L2_PREFETCH` is set to the most MiB to prefetch per weight (0 or unset: off), and only for
steps of at most `max_tokens` tokens, where the projections are memory-bound.
"""

from __future__ import annotations

import os

import torch

from tpfuse.kernels import l2_prefetch_op


def l2_prefetch_budget_bytes() -> int:
    """The TPFUSE_L2_PREFETCH setting in bytes (0: off). Raises ValueError on a bad value."""
    raw = os.environ.get("TPFUSE_L2_PREFETCH", "0").strip() or "0"
    try:
        mib = float(raw)
    except ValueError:
        raise ValueError(f"TPFUSE_L2_PREFETCH must be a number of MiB (0 = off), got {raw!r}") from None
    if mib < 0:
        raise ValueError(f"TPFUSE_L2_PREFETCH must be >= 0 MiB, got {raw!r}")
    return int(mib * (1 << 20))


class L2Prefetcher:
    def __init__(self, device: torch.device, budget_bytes: int, max_tokens: int = 64):
        """device: a CUDA device; budget_bytes: the most bytes read per prefetched weight."""
        if device.type != "cuda":
            raise ValueError(f"L2Prefetcher needs a CUDA device, got {device}")
        self.device = device
        self.budget_bytes = budget_bytes
        self.max_tokens = max_tokens
        self.num_programs = torch.cuda.get_device_properties(device).multi_processor_count
        self.stream = torch.cuda.Stream(device)
        self.sink = torch.zeros(self.num_programs, dtype=torch.int32, device=device)
        self._forked = False

    @classmethod
    def from_env(cls, device: torch.device) -> L2Prefetcher | None:
        budget = l2_prefetch_budget_bytes()
        return cls(device, budget) if budget > 0 and device.type == "cuda" else None

    def prefetch(self, weight: torch.Tensor, num_tokens: int) -> None:
        """Starts reading (the first budget bytes of) weight on the side stream, after the work the
        current stream has queued so far. A no-op for steps of more than max_tokens tokens."""
        if num_tokens > self.max_tokens:
            return
        part = weight.reshape(-1)[: max(1, self.budget_bytes // weight.element_size())]
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            l2_prefetch_op(part, self.sink, self.num_programs)
        self._forked = True

    def join(self) -> None:
        """Makes the current stream wait for every prefetch issued since the last join (a CUDA graph
        capture must end with its side streams joined)."""
        if self._forked:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._forked = False
