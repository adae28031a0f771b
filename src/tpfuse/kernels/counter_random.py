"""Counter-based uniform random numbers: uniform(seed, stream, counter), one launch on the GPU.

Every draw is a pure function of a row's seed, a stream id and a counter (murmur3's 32-bit finaliser
chained over the seed halves, the stream and the counter, two hashes giving 53 bits), so a seeded row
gets the same draws whatever else is in the batch, on CPU and GPU alike, with no generator state and
no host synchronisation. The reference is plain int64 torch arithmetic (no product reaches 2^63); the
Triton kernel computes the same hashes in uint64 in one launch instead of about a hundred small ones,
which matters because speculative verification draws on every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
SECOND_HASH_SALT = 0x5BD1E995


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), split into 16-bit halves of c so nothing overflows int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def _fmix32_ref(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _broadcast_counters(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    counters = counters.to(device=seeds.device, dtype=torch.int64)
    return counters[None, :].expand(seeds.shape[0], -1) if counters.dim() == 1 else counters


def uniform_ref(seeds: torch.Tensor, stream: int, counters: torch.Tensor) -> torch.Tensor:
    """Uniform draws in [0, 1), float64, 53 random bits each.

    seeds: [B] int64 (any value, negative included); stream: a small int naming the purpose of the
    draws (so two purposes never share numbers); counters: [N] or [B, N] int64 >= 0.
    Returns a new [B, N] float64 tensor on seeds.device.
    """
    seeds = seeds.to(torch.int64)
    counters = _broadcast_counters(seeds, counters)
    seed_lo = (seeds & MASK32)[:, None]
    seed_hi = ((seeds >> 32) & MASK32)[:, None]
    h = _fmix32_ref(seed_lo ^ GOLDEN)
    h = _fmix32_ref(h ^ seed_hi)
    h = _fmix32_ref(h ^ _mul32(torch.full_like(h, stream & MASK32), GOLDEN))
    h = _fmix32_ref(h ^ (counters & MASK32))
    h2 = _fmix32_ref(h ^ SECOND_HASH_SALT)
    bits = (h << 21) | (h2 >> 11)  # 32 + 21 = 53 bits
    return bits.to(torch.float64) * (2.0**-53)


@triton.jit
def _fmix32(h):
    """murmur3's finaliser on a 32-bit value held in uint64 (products stay below 2^64)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


UNIFORM_BLOCK = 64


# One compilation serves every shape: no specialisation on the sizes (a verify step's first draws
# at a new k must not pay a JIT compile inside a timed step).
@triton.jit(do_not_specialize=["stream_word", "n", "stride_cb"])
def _uniform_kernel(seeds_ptr, counters_ptr, out_ptr, stream_word, n, stride_cb, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
    counter = tl.load(counters_ptr + row * stride_cb + cols, mask=mask, other=0).to(tl.uint64, bitcast=True)
    h = _fmix32((seed & 0xFFFFFFFF) ^ 0x9E3779B9)
    h = _fmix32(h ^ (seed >> 32))
    h = _fmix32(h ^ stream_word.to(tl.uint64))
    h = _fmix32(h ^ (counter & 0xFFFFFFFF))
    h2 = _fmix32(h ^ 0x5BD1E995)
    bits = (h << 21) | (h2 >> 11)
    tl.store(out_ptr + row * n + cols, bits.to(tl.float64) * 1.1102230246251565e-16, mask=mask)  # 2^-53


def uniform_triton(seeds: torch.Tensor, stream: int, counters: torch.Tensor) -> torch.Tensor:
    """Triton uniform_ref (same arguments, bit-identical draws)."""
    seeds = seeds.to(torch.int64).contiguous()
    counters = counters.to(device=seeds.device, dtype=torch.int64)
    batch = seeds.shape[0]
    n = counters.shape[-1]
    out = torch.empty((batch, n), dtype=torch.float64, device=seeds.device)
    if batch == 0 or n == 0:
        return out
    if counters.stride(-1) != 1:
        counters = counters.contiguous()
    stride_cb = 0 if counters.dim() == 1 else counters.stride(0)  # 0: one counter row for every seed
    stream_word = ((stream & MASK32) * GOLDEN) & MASK32
    _uniform_kernel[(batch, triton.cdiv(n, UNIFORM_BLOCK))](
        seeds, counters, out, stream_word, n, stride_cb, BLOCK=UNIFORM_BLOCK
    )
    return out
