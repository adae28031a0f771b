"""FP8 W8A8 prefill on cuBLASLt through torch._scaled_mm, where this torch and GPU take the scales.

The weights stay in kernels/quant_fp8.py's layout (e4m3 [N, K], one float32 scale per row and K
block). x is quantized as the Triton prefill form quantizes it (kernels/quant_fp8_w8a8.py), then:
  - per-channel weights (one K block): row-wise scaling, scale_a [M, 1] x scale_b [1, N];
  - 128-column K blocks: cuBLASLt's 1x128 x 1x128 block scaling (CUDA >= 12.9), scale_a
    [M, K / 128] column-major (M padded to a multiple of 4) and scale_b [K / 128, N] row-major, each
    "outer-dim-major" for its operand (x [M, K] and weight.t() [K, N]).
scaled_mm_supported probes each form once per device by running it against the reference, never by
architecture or version; start-up timing (model/linear_choice.py) races it per weight shape against
the Triton prefill kernel past 64 rows and against the W8A8 decode tiles at 16-64 rows, so it runs
only where it is faster.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from tpfuse.kernels.quant_fp8 import FP8_DTYPE, check_fp8_weights
from tpfuse.kernels.quant_fp8_w8a8 import activation_group, fp8_w8a8_ref, quantize_fp8_rows_into

log = logging.getLogger("tpfuse")

BLOCK_K = 128  # the only K block cuBLASLt's block scaling takes
ROW_ALIGN = 4  # scale_a's column stride is the row count: 16-byte aligned


@dataclass(frozen=True)
class GemmRoute:
    """An FP8 W8A8 product as one GEMM: the Triton tensor-core prefill kernel, or torch._scaled_mm;
    start-up timing races them past 64 rows, and torch._scaled_mm against the decode tiles at 16-64.
    fp8_rows: the Triton kernel on input its producer already quantized per row (kernels/fp8_rows.py),
    so the product launches no quantization of its own."""

    scaled_mm: bool
    fp8_rows: bool = False

    def label(self) -> str:
        if self.fp8_rows:
            return "triton w8a8 prefill on fp8 rows"
        return "torch._scaled_mm" if self.scaled_mm else "triton w8a8 prefill"


class ScaledMmUnavailable(RuntimeError):
    """torch._scaled_mm (cuBLASLt) cannot run this product here: start-up timing leaves the route out."""


TRITON_PREFILL = GemmRoute(scaled_mm=False)
SCALED_MM = GemmRoute(scaled_mm=True)
FP8_ROWS = GemmRoute(scaled_mm=False, fp8_rows=True)


def row_scales(scale: torch.Tensor, block: tuple[int, int], num_cols: int) -> torch.Tensor:
    """The weight's scales one row each: [N, K blocks] (block rows repeated)."""
    return scale if block[0] == 1 else scale.repeat_interleave(block[0], 0)[:num_cols]


def weight_scales_b(scale: torch.Tensor, block: tuple[int, int], num_cols: int) -> torch.Tensor:
    """scale_b for mat_b = weight.t() [K, N], a new tensor: [1, N] per-channel, else one scale per
    (K block, column), [K blocks, N] row-major. A layer makes it once (model/quant/fp8.py)."""
    scales = row_scales(scale, block, num_cols).float()
    return scales.reshape(1, num_cols).clone() if scales.shape[1] == 1 else scales.t().contiguous()


def fp8_scaled_mm(x, weight, scale, block, bias=None, scale_b=None) -> torch.Tensor:
    """x [M, K] bf16/fp16 @ (weight [N, K] e4m3 * scale).T (+ bias) -> new [M, N] in x.dtype, x quantized
    per row (per-channel) or per row and 128 columns (block); scale_b: weight_scales_b(scale, ...)
    made beforehand (else made here, a copy a call). Raises ValueError for K blocks other than 128,
    ScaledMmUnavailable where torch._scaled_mm cannot run the product."""
    num_rows, hidden = x.shape
    check_fp8_weights(weight, scale, block, hidden)
    group = activation_group(block, hidden)
    if group < hidden and group != BLOCK_K:
        raise ValueError(f"torch._scaled_mm takes {BLOCK_K}-column K blocks; this weight has {group}")
    num_cols = weight.shape[0]
    if scale_b is None:
        scale_b = weight_scales_b(scale, block, num_cols)
    padded = -(-max(num_rows, 1) // ROW_ALIGN) * ROW_ALIGN
    groups = -(-hidden // group)
    xq = torch.empty((padded, hidden), dtype=FP8_DTYPE, device=x.device)
    if padded > num_rows:  # rows past x's: zero codes at scale 1, not stale bytes
        xq[num_rows:].zero_()
    x_scales = torch.ones((groups, padded), dtype=torch.float32, device=x.device).t()
    quantize_fp8_rows_into(x, group, xq, x_scales)
    try:
        out = torch._scaled_mm(xq, weight.t(), scale_a=x_scales, scale_b=scale_b, out_dtype=x.dtype)
    except (RuntimeError, NotImplementedError) as error:
        shape = f"{num_rows} x {hidden} x {num_cols}"
        raise ScaledMmUnavailable(f"torch._scaled_mm refused a {shape} product: {error}") from error
    out = out[:num_rows]
    return out if bias is None else out.add_(bias)


@functools.cache
def scaled_mm_supported(device: torch.device, per_block: bool) -> bool:
    """Whether torch._scaled_mm runs the per-block (or per-channel) form correctly on this CUDA device:
    one small product against the reference, asked once per device and form."""
    if device.type != "cuda":
        return False
    form = "1x128 block" if per_block else "row-wise"
    try:
        generator = torch.Generator(device).manual_seed(0)
        rows, hidden, cols = 6, 2 * BLOCK_K, 64
        block = (1, BLOCK_K) if per_block else (1, hidden)
        x = torch.randn(rows, hidden, device=device, generator=generator).to(torch.bfloat16)
        weight = torch.randn(cols, hidden, device=device, generator=generator).to(FP8_DTYPE)
        scale = torch.rand(cols, hidden // block[1], device=device, generator=generator) + 0.5
        out = fp8_scaled_mm(x, weight, scale, block).float()
        reference = fp8_w8a8_ref(x, weight, scale, block).float()
        agrees = bool(torch.allclose(out, reference, rtol=2e-2, atol=2e-2 * reference.abs().max().item()))
        if not agrees:
            log.info("torch._scaled_mm with %s scales disagrees with the reference here; not used", form)
        return agrees
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        log.info("torch._scaled_mm with %s scales is not available here (%s)", form, reason)
        return False
