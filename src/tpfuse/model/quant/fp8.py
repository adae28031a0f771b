"""FP8 e4m3 weights: per-tensor and per-channel scales (compressed-tensors float-quantized) and
128x128 block scales (`quant_method: fp8` with weight_block_size, stored as weight_scale_inv).

Whatever the checkpoint's granularity, the rank keeps weight [N_local, K_local] e4m3 and one float32
scale per (row, K block) (kernels/quant_fp8.py): per-channel and per-tensor scales become [N_local, 1]
(block (1, K)), block scales [N_local, ceil(K_local / 128)] (block (1, 128)), expanded exactly at load,
so merged parts (q, k, v) and tensor-parallel shards need not fall on 128-row boundaries. Where every
part does, the checkpoint's [N_local / 128, K_local / 128] scales are kept too (tile_scale), and the
Triton kernels read those: one scale a tile or a K step instead of one a row. Row-parallel shards must
start on a K block.

Compute, where the checkpoint quantizes activations to FP8 (W8A8: `quant_method: fp8`, compressed-tensors
with FP8 input_activations, the dummy fp8 formats) and the GPU passes the FP8-dot probe:
  - more than 64 rows: FP8 x FP8 on the tensor cores, activations quantized per row (per-channel) or
    per 128-column group (block), on the Triton kernel or torch._scaled_mm (kernels/fp8_scaled_mm.py),
    whichever start-up timing finds faster for the weight's shape at the engine's prefill chunk;
  - 1-64 rows: whichever start-up timing picks per weight shape and row bucket, the W8A16 tiles (the
    weight dequantized in registers against bf16 activations) or the W8A8 decode form
    (kernels/quant_fp8_w8a8.py: activations quantized per row and 128-column step).
Where the activations are quantized one scale a row (per-channel and per-tensor weights) or a
128-column block (128 x 128 blocks), start-up timing also times FP8_ROWS past 64 rows: the Triton
kernel on rows the layer's producer (the fused all-reduce + RMSNorm before it) already quantized
(kernels/fp8_rows.py), without that quantization, which the producer's epilogue does; where it beats
the best route on the plain tensor, the layer takes FP8 rows (input_form: model/input_forms.py's
Fp8RowsForm) and its producer writes them (a plain tensor from a producer that cannot still takes the
best route). Weight-only checkpoints
(no input_activations) and GPUs without FP8 tensor cores run W8A16 throughout. Static input scales,
where a checkpoint has them, are read and not used: activations are quantized dynamically.
"""

from __future__ import annotations

import torch
from torch import nn

from tpfuse.kernels import fp8_linear_op, fp8_rows_linear_op, use_triton
from tpfuse.kernels.fp8_rows import BLOCK_GROUP, Fp8Rows
from tpfuse.kernels.fp8_scaled_mm import (
    FP8_ROWS,
    SCALED_MM,
    TRITON_PREFILL,
    GemmRoute,
    fp8_scaled_mm,
    scaled_mm_supported,
    weight_scales_b,
)
from tpfuse.kernels.quant_fp8 import FP8_DTYPE, FP8_TILES, dequantize_fp8
from tpfuse.kernels.quant_fp8_w8a8 import W8A8_TILES, activation_group, decode_group, fp8_dot_supported
from tpfuse.model import linear_choice
from tpfuse.model.input_forms import Fp8RowsForm
from tpfuse.model.linear_method import LinearShards, reference_product
from tpfuse.model.quant.common import FP8_STORED, dummy_fp8, dummy_scale
from tpfuse.model.shard import ShardSlot, empty_parameter

MAX_DECODE_ROWS = 64


class Fp8LinearMethod:
    """strategy: "tensor", "channel" or "block" (block: the checkpoint's [block_n, block_k]);
    input_scales: the checkpoint stores static ones (read, not used); activations: the format
    quantizes activations to FP8 (W8A8 where the GPU can), else weight-only (W8A16)."""

    def __init__(
        self,
        strategy: str,
        block: tuple[int, int] | None = None,
        input_scales: bool = False,
        activations: bool = True,
    ):
        if strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"FP8 weight strategy {strategy!r} is not one of tensor, channel, block")
        self.strategy = strategy
        self.checkpoint_block = block
        self.input_scales = input_scales
        self.activations = activations
        self.name = f"fp8-{strategy}" + (f" {block[0]}x{block[1]}" if block else "")

    def create_weights(self, layer: nn.Module, shards: LinearShards, dtype: torch.dtype) -> None:
        layer.weight = empty_parameter(shards.n_local, shards.k_local, dtype=FP8_DTYPE)
        if self.input_scales:
            layer.input_scale = empty_parameter(len(shards.parts), dtype=torch.float32)
        if self.strategy != "block":
            layer.weight_scale = empty_parameter(shards.n_local, 1, dtype=torch.float32)
            layer.fp8_block = (1, shards.k_local)
            return
        block_n, block_k = self.checkpoint_block
        if shards.input_start % block_k:
            raise ValueError(
                f"a row-parallel FP8 shard starts at input column {shards.input_start}, "
                f"inside a {block_k}-column "
                "scale block; choose a --tp-size that splits the input size into multiples of the block"
            )
        k_blocks = -(-shards.k_local // block_k)
        layer.block_scale_parts = nn.ParameterList()
        for _, start, local in shards.parts:
            rows = -(-(start + local) // block_n) - start // block_n
            layer.block_scale_parts.append(empty_parameter(rows, k_blocks, dtype=torch.float32))
        layer.fp8_block = (1, block_k)

    def checkpoint_slots(self, layer: nn.Module, part: int) -> dict[str, ShardSlot]:
        shards: LinearShards = layer.shards
        full, start, local = shards.parts[part]
        offset = shards.row_offset(part)
        k_full, k_start, k_local = shards.input_full, shards.input_start, shards.k_local
        codes = {"stored_dtypes": FP8_STORED, "dummy": dummy_fp8}
        if shards.input_sharded:
            weight = ShardSlot(layer.weight, (full, k_full), 1, k_start, k_local, **codes)
        else:
            weight = ShardSlot(layer.weight, (full, k_full), 0, start, local, offset, **codes)
        slots = {"weight": weight}
        if self.input_scales:
            slots["input_scale"] = ShardSlot(layer.input_scale, (1,), 0, 0, 1, part, broadcast=True)
        if self.strategy == "tensor":
            slots["weight_scale"] = ShardSlot(
                layer.weight_scale, (1,), 0, 0, local, offset, broadcast=True, dummy=dummy_scale
            )
        elif self.strategy == "channel":
            slots["weight_scale"] = ShardSlot(
                layer.weight_scale, (full, 1), 0, start, local, offset, dummy=dummy_scale
            )
        else:
            block_n, block_k = self.checkpoint_block
            raw = layer.block_scale_parts[part]
            shape = (-(-full // block_n), -(-k_full // block_k))
            if shards.input_sharded:
                slot = ShardSlot(raw, shape, 1, k_start // block_k, raw.shape[1], dummy=dummy_scale)
            else:
                slot = ShardSlot(raw, shape, 0, start // block_n, raw.shape[0], dummy=dummy_scale)
            slots["weight_scale_inv"] = slot
        return slots

    def process_weights(self, layer: nn.Module) -> None:
        if self.strategy == "block":
            self._expand_block_scales(layer)
        if layer.weight.is_cuda:  # probe now: apply may first see > 64 rows inside a graph capture
            fp8_dot_supported(layer.weight.device)
        # torch._scaled_mm's weight scales, laid out once (not a copy a product) where it may run
        layer.scaled_mm_scales = None
        if layer.weight.is_cuda and self._w8a8(layer) and self._scaled_mm_fits(layer):
            num_cols = layer.weight.shape[0]
            layer.scaled_mm_scales = weight_scales_b(layer.weight_scale, layer.fp8_block, num_cols)

    def _expand_block_scales(self, layer: nn.Module) -> None:
        """The checkpoint's [rows / 128, K / 128] scale parts -> weight_scale, one row per weight row."""
        block_n = self.checkpoint_block[0]
        expanded = []
        for (_, start, local), raw in zip(layer.shards.parts, layer.block_scale_parts, strict=True):
            rows = torch.arange(start, start + local, device=raw.device) // block_n - start // block_n
            expanded.append(raw.data[rows])
        parts = layer.shards.parts
        whole_blocks = all(start % block_n == 0 and local % block_n == 0 for _, start, local in parts)
        # Every part in whole 128-row blocks: the checkpoint's scales as they are, for the Triton
        # kernels' one-scale-a-tile forms (TILE_SCALE of kernels/quant_fp8_w8a8.py and quant_dot.py,
        # X_SCALE of the GEMV in kernels/quant_fp8.py).
        layer.tile_scale = torch.cat([raw.data for raw in layer.block_scale_parts]) if whole_blocks else None
        del layer.block_scale_parts
        layer.weight_scale = empty_parameter(0, dtype=torch.float32)
        layer.weight_scale.data = torch.cat(expanded).contiguous()

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The float32 weight [N_local, K_local] after process_weights (exact)."""
        return dequantize_fp8(layer.weight, layer.weight_scale, layer.fp8_block)

    def experts(self):
        """The MoE experts in the same format (model/quant/experts.py)."""
        from tpfuse.model.quant.experts import Fp8Experts

        return Fp8Experts(self.strategy, self.checkpoint_block, self.activations)

    def tile_key(self, layer: nn.Module) -> tuple:
        kept = getattr(layer, "tile_scale", None) is not None
        return (self.name, tuple(layer.weight.shape), layer.fp8_block, kept)

    def _w8a8(self, layer: nn.Module) -> bool:
        return self.activations and fp8_dot_supported(layer.weight.device)

    def tile_candidates(self, rows_bucket: int, layer: nn.Module):
        """The tiles start-up timing tries for layer: the W8A16 ones (kernels/quant_fp8.py), and where
        the format and the GPU allow W8A8, the decode form's (kernels/quant_fp8_w8a8.py) and from 16
        rows torch._scaled_mm."""
        w8a8 = ()
        if self._w8a8(layer):
            try:
                decode_group(layer.fp8_block, layer.weight.shape[1])
                w8a8 = W8A8_TILES[rows_bucket]
            except ValueError:  # K blocks without a power-of-two step of 16: W8A16 only
                pass
            if rows_bucket >= 16 and self._scaled_mm_fits(layer):
                w8a8 += (SCALED_MM,)
        return FP8_TILES[rows_bucket] + w8a8

    def _scaled_mm_fits(self, layer: nn.Module) -> bool:
        per_block = activation_group(layer.fp8_block, layer.weight.shape[1]) < layer.weight.shape[1]
        fits = all(size % 16 == 0 for size in layer.weight.shape)  # cuBLASLt's FP8 leading dimensions
        return fits and scaled_mm_supported(layer.weight.device, per_block)

    def prefill_candidates(self, layer: nn.Module) -> tuple[GemmRoute, ...]:
        """The W8A8 routes start-up timing races past 64 rows: the Triton tensor-core kernel, and
        torch._scaled_mm where it runs this form here (kernels/fp8_scaled_mm.py); none for W8A16."""
        if not self._w8a8(layer):
            return ()
        return (TRITON_PREFILL, SCALED_MM) if self._scaled_mm_fits(layer) else (TRITON_PREFILL,)

    def form_candidates(self, layer: nn.Module, rows_bucket) -> tuple:
        """(Fp8RowsForm, (FP8_ROWS,)): the route on FP8 rows that start-up timing races past 64 rows
        against the prefill_candidates' best, where W8A8 runs with activation groups FP8 rows take
        (_rows_group); else (None, ())."""
        group = self._rows_group(layer)
        if rows_bucket != linear_choice.PREFILL or not self._w8a8(layer) or group is None:
            return None, ()
        return Fp8RowsForm(group), (FP8_ROWS,)

    def _rows_group(self, layer: nn.Module) -> int | None:
        """The layer's W8A8 activation group where FP8 rows take it (the whole row: per-channel and
        per-tensor weights; kernels/fp8_rows.py's BLOCK_GROUP: 128 x 128 blocks), else None."""
        hidden = layer.weight.shape[1]
        group = activation_group(layer.fp8_block, hidden)
        return group if group in (hidden, BLOCK_GROUP) else None

    def input_form(self, layer: nn.Module, rows: int) -> Fp8RowsForm | None:
        """FP8 rows of the layer's activation group at `rows` rows, where start-up timing found FP8_ROWS
        faster than the best prefill route on the plain tensor (linear_choice.form_route); None: the
        plain tensor."""
        if linear_choice.form_route(layer, rows) is None:
            return None
        return Fp8RowsForm(self._rows_group(layer))

    def _triton_scales(self, layer: nn.Module) -> tuple[torch.Tensor, tuple[int, int]]:
        """(scale, block) the Triton kernels read: the checkpoint's block scales where they are kept
        (tile_scale: one scale a tile or a K step, not one a row), else one a row and K block."""
        tile_scale = getattr(layer, "tile_scale", None)
        if tile_scale is not None:
            return tile_scale, (self.checkpoint_block[0], layer.fp8_block[1])
        return layer.weight_scale, layer.fp8_block

    def product(self, layer: nn.Module, x, bias: torch.Tensor | None, tile) -> torch.Tensor:
        """The product at a given tile or route (W8A16, a W8A8Tile's decode form, a GemmRoute):
        what linear_choice times; x a tensor, or FP8 rows (Fp8RowsForm.make) for FP8_ROWS. The Triton
        kernels read the checkpoint's block scales where they are kept (tile_scale: one scale a tile or
        a K step, not one a row), torch._scaled_mm its own."""
        if isinstance(x, Fp8Rows) or tile == FP8_ROWS:
            rows = Fp8RowsForm(self._rows_group(layer)).make(x) if isinstance(x, torch.Tensor) else x
            return fp8_rows_linear_op(rows, layer.weight, *self._triton_scales(layer), bias)
        if tile == SCALED_MM and use_triton(x):
            scale_b = layer.scaled_mm_scales
            return fp8_scaled_mm(x, layer.weight, layer.weight_scale, layer.fp8_block, bias, scale_b=scale_b)
        return fp8_linear_op(x, layer.weight, *self._triton_scales(layer), bias, tile=tile)

    def apply(self, layer: nn.Module, x: torch.Tensor | Fp8Rows, bias: torch.Tensor | None):
        if isinstance(x, Fp8Rows):  # a producer quantized it: input_form
            return self.product(layer, x, bias, FP8_ROWS)
        if not use_triton(x):
            return reference_product(layer, x, bias, lambda: self.dequantize(layer))
        if x.shape[0] <= MAX_DECODE_ROWS:
            return self.product(layer, x, bias, linear_choice.quant_tile(layer, x.shape[0]))
        if not self._w8a8(layer):
            return self.product(layer, x, bias, None)
        return self.product(layer, x, bias, linear_choice.quant_tile(layer, x.shape[0]) or TRITON_PREFILL)


def parse_fp8(qc: dict, source: str):
    """`quant_method: fp8` (Qwen3-FP8, DeepSeek-V3): e4m3 weights with weight_scale_inv per block.
    Raises QuantizationError naming the field tpfuse cannot run."""
    from tpfuse.model.quant.common import QuantizationError, UniformConfig, check_ignored, typed

    where = f"{source}: quantization_config"
    if qc.get("fmt", "e4m3") != "e4m3":
        raise QuantizationError(f"{where}.fmt {qc['fmt']!r} is not supported; tpfuse runs e4m3 FP8")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise QuantizationError(
            f"{where}.weight_block_size must be [block_n, block_k] (e.g. [128, 128]); got {block!r}"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantizationError(f"{where}.activation_scheme {scheme!r} is not one of dynamic, static")
    ignored = typed(qc, "modules_to_not_convert", list, where, [])
    if not all(isinstance(module, str) for module in ignored):
        raise QuantizationError(f"{where}.modules_to_not_convert must list module names; got {ignored!r}")
    check_ignored(ignored, f"{where}.modules_to_not_convert")
    return UniformConfig("fp8", Fp8LinearMethod("block", tuple(block), scheme == "static"))
