"""Top-k / top-p without sorting the vocabulary: one cut value per row.

For a row of scaled logits z = logits / temperature, the tokens apply_top_k_top_p keeps are the
largest ones down to a cut: the k-th largest value (top-k), then within those the value at which
the probability mass taken from the top first reaches top_p (top-p). `row_cuts` finds that value
exactly by bisection over the float32 values' order-preserving integer keys: at most 32 passes
over the row for each of the two rules, counting (top-k) or summing exp(z - max) (top-p) above the
midpoint. The sampler then keeps z >= cut. Ties at the cut are all kept (the sort keeps an
arbitrary subset of them). Greedy rows get -inf (they never read it).

Cost per row: a pass reads the row once (from L2 when it fits); at a 128k vocabulary that is far
less than a sort of [rows, 128k]. No host sync, so it may run inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BISECTION_STEPS = 32  # float32 keys span at most 2^32 values


@triton.jit
def _key(z):
    """Order-preserving int32 key of float32 z (no NaN): a < b exactly when key(a) < key(b)."""
    bits = z.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _value(key):
    """The float32 of an int32 key (inverse of _key)."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _above(row_ptr, vocab, temperature, z_max, threshold, MASS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Over the row: the count (MASS False) or the sum of exp(z - z_max) (MASS True) of the values
    whose key is >= threshold (int64)."""
    total = tl.zeros([], dtype=tl.float32)
    for start in range(0, vocab, BLOCK_V):
        tokens = start + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + tokens, mask=tokens < vocab, other=float("-inf")).to(tl.float32) / temperature
        take = (_key(z).to(tl.int64) >= threshold) & (tokens < vocab)
        if MASS:
            total += tl.sum(tl.where(take, tl.exp(z - z_max), 0.0), axis=0)
        else:
            total += tl.sum(take.to(tl.float32), axis=0)
    return total


@triton.jit
def _largest_key(row_ptr, vocab, temperature, z_max, lo, hi, need, MASS: tl.constexpr, BLOCK_V: tl.constexpr,
                 STEPS: tl.constexpr):  # fmt: skip
    """The largest key in [lo, hi] whose _above is >= need (_above(lo) >= need holds)."""
    for _ in range(STEPS):
        mid = lo + (hi - lo + 1) // 2
        enough = _above(row_ptr, vocab, temperature, z_max, mid, MASS, BLOCK_V) >= need
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    return lo


@triton.jit
def _row_cut_kernel(
    logits_ptr,
    temperatures_ptr,
    top_ks_ptr,
    top_ps_ptr,
    cuts_ptr,
    vocab,
    stride,
    BLOCK_V: tl.constexpr,
    STEPS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperatures_ptr + row).to(tl.float32)
    if temperature <= 0.0:
        tl.store(cuts_ptr + row, float("-inf"))
    else:
        row_ptr = logits_ptr + row * stride
        z_max = tl.full([], float("-inf"), tl.float32)
        z_min = tl.full([], float("inf"), tl.float32)
        for start in range(0, vocab, BLOCK_V):
            tokens = start + tl.arange(0, BLOCK_V)
            valid = tokens < vocab
            z = tl.load(row_ptr + tokens, mask=valid, other=0.0).to(tl.float32) / temperature
            z_max = tl.maximum(z_max, tl.max(tl.where(valid, z, float("-inf")), axis=0))
            z_min = tl.minimum(z_min, tl.min(tl.where(valid, z, float("inf")), axis=0))
        lo = _key(z_min).to(tl.int64)
        hi = _key(z_max).to(tl.int64)
        k = tl.load(top_ks_ptr + row)
        if (k > 0) & (k < vocab):
            lo = _largest_key(
                row_ptr, vocab, temperature, z_max, lo, hi, k.to(tl.float32), False, BLOCK_V, STEPS
            )
        p = tl.load(top_ps_ptr + row).to(tl.float32)
        if p < 1.0:
            kept = _above(row_ptr, vocab, temperature, z_max, lo, True, BLOCK_V)
            lo = _largest_key(row_ptr, vocab, temperature, z_max, lo, hi, p * kept, True, BLOCK_V, STEPS)
        tl.store(cuts_ptr + row, _value(lo.to(tl.int32)))


def row_cuts(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor):
    """[B] float32: per row, the smallest z = logits / temperature that top-k (k <= 0 or >= V: off) and
    top-p (p >= 1: off) keep; -inf for greedy rows and rows that filter nothing. logits [B, V] any
    float dtype, last dim contiguous; the sampler must compute z with the same float32 division."""
    batch, vocab = logits.shape
    cuts = torch.empty(batch, dtype=torch.float32, device=logits.device)
    if batch:
        _row_cut_kernel[(batch,)](
            logits, temperatures, top_ks, top_ps, cuts, vocab, logits.stride(0),
            BLOCK_V=min(triton.next_power_of_2(vocab), 4096), STEPS=BISECTION_STEPS, num_warps=8,
        )  # fmt: skip
    return cuts
