"""Counter-based random numbers for speculative verification: uniform(seed, stream, counter).

Every draw is a pure function of a row's seed, a stream id and a counter, so a seeded request gets
the same draws whatever else is in the batch, on CPU and GPU alike, without per-row generators and
without host synchronisation (capturable in CUDA graphs). The hash and its Triton kernel live in
kernels/counter_random.py; this is the name the verifiers call.
"""

from __future__ import annotations

import torch

from tpfuse.kernels import counter_uniform


def uniform(seeds: torch.Tensor, stream: int, counters: torch.Tensor) -> torch.Tensor:
    """Uniform draws in [0, 1), float64, 53 random bits each.

    seeds: [B] int64 (any value, negative included); stream: a small int naming the purpose of the
    draws (so two purposes never share numbers); counters: [N] or [B, N] int64 >= 0.
    Returns a new [B, N] float64 tensor on seeds.device.
    """
    return counter_uniform(seeds, stream, counters)
