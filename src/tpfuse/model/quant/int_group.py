"""Group-quantized integer weights (W4A16 / W8A16) in the kernels' layout (kernels/quant_int.py),
loaded from compressed-tensors pack-quantized tensors, whose layout it is:

  <name>.weight_packed  [N, ceil(K / (32 / bits))] int32, values + 2^(bits-1) packed along K
  <name>.weight_scale   [N, ceil(K / group_size)] float
  <name>.weight_shape   [2] int: (N, K), checked at load

Column-parallel shards split rows; row-parallel shards split K at a group (and word) boundary, so
the scales shard along K with the codes. Formats with other layouts (GPTQ, GGUF) subclass this and
convert to it in process_weights.

At one row, 4-bit layouts the f16x2 GEMV takes (kernels/quant_int_half2.py) may also take their input
as that GEMV's operands made by the producer (model/input_forms.py's Half2XForm), where start-up
timing finds the GEMV on them faster than the best tile on the plain row.
"""

from __future__ import annotations

import torch
from torch import nn

from tpfuse.kernels import int_linear_op, use_triton
from tpfuse.kernels.quant_int import dequantize_int, values_per_word
from tpfuse.kernels.quant_int_half2 import VECTOR_VALUES, Half2Tile, Half2X
from tpfuse.model import linear_choice
from tpfuse.model.input_forms import HALF2X, Half2XForm
from tpfuse.model.linear_method import LinearShards, reference_product
from tpfuse.model.quant.common import INT_STORED, QuantizationError, dummy_codes, dummy_group_scale
from tpfuse.model.shard import ShardSlot, empty_parameter


class IntGroupLinearMethod:
    """bits 4 or 8, symmetric, group_size columns of K per scale (-1: the whole K)."""

    def __init__(self, bits: int, group_size: int, scale_dtype: torch.dtype | None = None, fmt: str = "int"):
        values_per_word(bits)
        self.bits = bits
        self.group_size = group_size
        self.scale_dtype = scale_dtype  # None: the run dtype
        self.name = f"{fmt}{bits} group {group_size}"

    def group_of(self, shards: LinearShards) -> int:
        return shards.input_full if self.group_size == -1 else self.group_size

    def _check_row_split(self, shards: LinearShards, group: int) -> None:
        per_word = values_per_word(self.bits)
        if shards.input_sharded and (shards.input_start % group or shards.input_start % per_word):
            raise ValueError(
                f"a row-parallel {self.name} shard starts at input column {shards.input_start}, inside a "
                f"quantization group of {group}; "
                "choose a --tp-size that splits the input size into whole groups"
            )

    def create_weights(self, layer: nn.Module, shards: LinearShards, dtype: torch.dtype) -> None:
        group = self.group_of(shards)
        self._check_row_split(shards, group)
        per_word = values_per_word(self.bits)
        layer.weight_packed = empty_parameter(
            shards.n_local, -(-shards.k_local // per_word), dtype=torch.int32
        )
        layer.weight_scale = empty_parameter(
            shards.n_local, -(-shards.k_local // group), dtype=self.scale_dtype or dtype
        )
        layer.weight_shape = empty_parameter(2 * len(shards.parts), dtype=torch.int64)
        layer.weight_offset = None
        layer.int_group = group

    def checkpoint_slots(self, layer: nn.Module, part: int) -> dict[str, ShardSlot]:
        shards: LinearShards = layer.shards
        full, start, local = shards.parts[part]
        offset = shards.row_offset(part)
        per_word, group = values_per_word(self.bits), layer.int_group
        k_full, k_start = shards.input_full, shards.input_start
        packed_shape = (full, -(-k_full // per_word))
        scale_shape = (full, -(-k_full // group))
        codes = {"stored_dtypes": INT_STORED, "dummy": dummy_codes}
        scale = {"dummy": dummy_group_scale(self.bits)}
        if shards.input_sharded:
            packed = ShardSlot(layer.weight_packed, packed_shape, 1, k_start // per_word,
                               layer.weight_packed.shape[1], **codes)  # fmt: skip
            scales = ShardSlot(
                layer.weight_scale, scale_shape, 1, k_start // group, layer.weight_scale.shape[1], **scale
            )
        else:
            packed = ShardSlot(layer.weight_packed, packed_shape, 0, start, local, offset, **codes)
            scales = ShardSlot(layer.weight_scale, scale_shape, 0, start, local, offset, **scale)

        def dummy_shape(dest: torch.Tensor, generator: torch.Generator, full=full) -> None:
            dest.copy_(torch.tensor([full, k_full]))

        shape = ShardSlot(
            layer.weight_shape, (2,), 0, 0, 2, 2 * part, stored_dtypes=("I32", "I64"), dummy=dummy_shape
        )
        return {"weight_packed": packed, "weight_scale": scales, "weight_shape": shape}

    def check_shapes(self, layer: nn.Module) -> None:
        """Each part's stored weight_shape must be (N, K) of the config."""
        names = getattr(layer, "checkpoint_names", None) or [
            f"part {i}" for i in range(len(layer.shards.parts))
        ]
        recorded = layer.weight_shape.view(-1, 2).tolist()
        for (full, _, _), (n, k), name in zip(layer.shards.parts, recorded, names, strict=True):
            if (n, k) != (full, layer.shards.input_full):
                raise ValueError(
                    f"{name}.weight_shape is [{n}, {k}] but the config needs "
                    f"[{full}, {layer.shards.input_full}]; "
                    "check config.json against the checkpoint"
                )

    def process_weights(self, layer: nn.Module) -> None:
        self.check_shapes(layer)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The float32 weight [N_local, K_local] after process_weights."""
        k = layer.shards.k_local
        return dequantize_int(layer.weight_packed, layer.weight_scale, layer.weight_offset, self.bits,
                              layer.int_group, k)  # fmt: skip

    def experts(self):
        """The MoE experts in the same format (model/quant/experts.py)."""
        from tpfuse.model.quant.experts import IntGroupExperts

        if self.group_size < 1:
            raise QuantizationError(f"{self.name}: quantized MoE experts need a group size (not per-channel)")
        return IntGroupExperts(self.bits, self.group_size)

    def tile_key(self, layer: nn.Module) -> tuple:
        return (self.name, tuple(layer.weight_packed.shape), layer.weight_offset is not None)

    def product(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, tile) -> torch.Tensor:
        return int_group_product(layer, x, bias, self.bits, layer.int_group, tile)

    def form_candidates(self, layer: nn.Module, rows_bucket) -> tuple:
        """(HALF2X, the f16x2 GEMV's start-up tiles) at one row where the layout fits that GEMV (4 bits,
        K and the group in whole 32-value vectors), else (None, ())."""
        k, group = layer.shards.k_local, layer.int_group
        fits = self.bits == 4 and k % VECTOR_VALUES == 0 and (group >= k or group % VECTOR_VALUES == 0)
        if rows_bucket != 1 or not fits:
            return None, ()
        return HALF2X, tuple(t for t in linear_choice.QUANT_TILES[1] if isinstance(t, Half2Tile))

    def input_form(self, layer: nn.Module, rows: int) -> Half2XForm | None:
        """HALF2X at one row where start-up timing chose the GEMV on it (linear_choice.form_route), else
        None (the plain tensor)."""
        return HALF2X if rows == 1 and linear_choice.form_route(layer, rows) is not None else None

    def apply(self, layer: nn.Module, x: torch.Tensor | Half2X, bias: torch.Tensor | None) -> torch.Tensor:
        choose = linear_choice.form_route if isinstance(x, Half2X) else linear_choice.quant_tile
        return int_group_product(layer, x, bias, self.bits, layer.int_group, choose(layer, x.shape[0]))


def int_group_product(
    layer: nn.Module, x: torch.Tensor, bias, bits: int, group: int, tile=None
) -> torch.Tensor:
    """layer.weight_packed / weight_scale / weight_offset (kernels/quant_int.py's layout) times x (or
    a Half2X): the Triton kernel (tile: its launch configuration, None: the default), or on the
    reference path the weight dequantized once and kept."""
    packed, scale, offset = layer.weight_packed, layer.weight_scale, layer.weight_offset
    if use_triton(x):
        return int_linear_op(x, packed, scale, offset, bits, group, bias, tile=tile)
    k = layer.shards.k_local
    dequantize = lambda: dequantize_int(packed, scale, offset, bits, group, k)  # noqa: E731
    if isinstance(x, Half2X):
        return reference_product(layer, x.values(), bias, dequantize).to(x.dtype)
    return reference_product(layer, x, bias, dequantize)
