"""GGUF linears: each layer runs its file's tensors through the group-quantized kernels when every
merged part (q/k/v, gate/up) is the same Q8_0, Q4_0 or Q4_1 type (tensors weight_packed,
weight_scale, weight_offset as model/gguf.py converts them), and dequantized in the run dtype otherwise.

The choice needs the layer's checkpoint names, which a linear learns only when the loader asks for
its slots, so the parameters are created then, on the device the layer was built on.
"""

from __future__ import annotations

import torch
from torch import nn

from tpfuse.model import linear_choice
from tpfuse.model.gguf import GROUP_SIZE, GROUP_TYPES, GgufFile
from tpfuse.model.linear_method import UNQUANTIZED, LinearShards, linear
from tpfuse.model.quant.int_group import int_group_product
from tpfuse.model.shard import ShardSlot


def _parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class GgufLinearMethod:
    name = "gguf"

    def __init__(self, file: GgufFile):
        self.file = file
        self.kind: str | None = None  # the GGUF type run by the group kernels, or None: dequantized

    def create_weights(self, layer: nn.Module, shards: LinearShards, dtype: torch.dtype) -> None:
        layer.gguf_device = torch.empty(0).device  # the device the model is being built on
        layer.gguf_dtype = dtype

    def _create(self, layer: nn.Module) -> None:
        shards: LinearShards = layer.shards
        types = {self.file.tensor_type(f"{name}.weight") for name in layer.checkpoint_names}
        kind = types.pop() if len(types) == 1 else None
        self.kind = kind if kind in GROUP_TYPES else None
        device, n, k = layer.gguf_device, shards.n_local, shards.k_local
        if self.kind is None:
            layer.weight = _parameter((n, k), layer.gguf_dtype, device)
            return
        if shards.input_start % GROUP_SIZE:
            raise ValueError(
                f"a row-parallel shard of {layer.checkpoint_names[0]} starts inside a {GROUP_SIZE}-value "
                "GGUF block; choose a --tp-size that splits the input size into whole blocks"
            )
        bits = GROUP_TYPES[self.kind]
        layer.weight_packed = _parameter((n, k * bits // 32), torch.int32, device)
        layer.weight_scale = _parameter((n, k // GROUP_SIZE), torch.float16, device)
        layer.weight_offset = (
            _parameter((n, k // GROUP_SIZE), torch.float32, device) if self.kind == "Q4_1" else None
        )

    def checkpoint_slots(self, layer: nn.Module, part: int) -> dict[str, ShardSlot]:
        if part == 0:
            self._create(layer)
        if self.kind is None:
            return UNQUANTIZED.checkpoint_slots(layer, part)
        shards: LinearShards = layer.shards
        full, start, local = shards.parts[part]
        offset = shards.row_offset(part)
        bits = GROUP_TYPES[self.kind]
        slots = {}
        for suffix, per_column in (
            ("weight_packed", 32 // bits),
            ("weight_scale", GROUP_SIZE),
            ("weight_offset", GROUP_SIZE),
        ):
            param = getattr(layer, suffix)
            if param is None:
                continue
            shape = (full, shards.input_full // per_column)
            if shards.input_sharded:
                slots[suffix] = ShardSlot(param, shape, 1, shards.input_start // per_column, param.shape[1])
            else:
                slots[suffix] = ShardSlot(param, shape, 0, start, local, offset)
        return slots

    def process_weights(self, layer: nn.Module) -> None:
        pass

    def tile_key(self, layer: nn.Module) -> tuple | None:
        if self.kind is None:
            return None  # dequantized: the unquantized routes (linear_choice.choose) apply
        return (f"gguf {self.kind}", tuple(layer.weight_packed.shape), layer.weight_offset is not None)

    def product(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, tile) -> torch.Tensor:
        return int_group_product(layer, x, bias, GROUP_TYPES[self.kind], GROUP_SIZE, tile)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kind is None:
            return linear(x, layer.weight, bias)
        return self.product(layer, x, bias, linear_choice.quant_tile(layer, x.shape[0]))


class GgufConfig:
    """Every decoder linear gets its own GgufLinearMethod (types vary per tensor); lm_head
    (output.weight, or the tied embedding) is dequantized."""

    def __init__(self, file: GgufFile):
        self.file = file
        self.name = f"GGUF {file.path}"

    def linear_method(self, role: str):
        return UNQUANTIZED if role == "lm_head" else GgufLinearMethod(self.file)

    def expert_method(self):
        raise ValueError(f"{self.file.path}: GGUF MoE experts are not supported")
