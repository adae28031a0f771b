"""Counter-based random numbers for speculative verification: uniform(seed, stream, counter).

Every draw is a pure function of a row's seed, a stream id and a counter, so a seeded request gets
the same draws whatever else is in the batch, on CPU and GPU alike, without per-row generators and
without host synchronisation (the ops are plain int64 tensor arithmetic, capturable in CUDA graphs).
The hash is murmur3's 32-bit finaliser, computed exactly in int64 (no product reaches 2^63).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), split into 16-bit halves of c so nothing overflows int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform(seeds: torch.Tensor, stream: int, counters: torch.Tensor) -> torch.Tensor:
    """Uniform draws in [0, 1), float64, 53 random bits each.

    seeds: [B] int64 (any value, negative included); stream: a small int naming the purpose of the
    draws (so two purposes never share numbers); counters: [N] or [B, N] int64 >= 0.
    Returns a new [B, N] float64 tensor on seeds.device.
    """
    seeds = seeds.to(torch.int64)
    counters = counters.to(device=seeds.device, dtype=torch.int64)
    if counters.dim() == 1:
        counters = counters[None, :].expand(seeds.shape[0], -1)
    seed_lo = (seeds & _MASK32)[:, None]
    seed_hi = ((seeds >> 32) & _MASK32)[:, None]
    h = _fmix32(seed_lo ^ _GOLDEN)
    h = _fmix32(h ^ seed_hi)
    h = _fmix32(h ^ _mul32(torch.full_like(h, stream & _MASK32), _GOLDEN))
    h = _fmix32(h ^ (counters & _MASK32))
    h2 = _fmix32(h ^ 0x5BD1E995)
    bits = (h << 21) | (h2 >> 11)  # 32 + 21 = 53 bits
    return bits.to(torch.float64) * (2.0**-53)
