"""DequantizedAtLoad: a linear stored in the checkpoint's quantized format but read as a plain weight.

MLA's kv_b_proj is the case: its rows are W_UK / W_UV, read in place by the absorbed attention's
batched products (model/mla.py), not through a linear kernel. The checkpoint's method names and
loads its tensors (codes and scales, sharded its way); process_weights dequantizes them once into
weight [N_local, K_local] of the run dtype and drops them. Over an unquantized method it changes
nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from tpfuse.model.linear_method import UNQUANTIZED, LinearMethod, LinearShards, linear
from tpfuse.model.quant.common import QuantizationError
from tpfuse.model.shard import ShardSlot


class DequantizedAtLoad:
    """Wraps the checkpoint's method of one linear. Raises QuantizationError at construction when
    that method has no exact dequantize(layer) (e.g. GGUF K-quants)."""

    def __init__(self, stored: LinearMethod, why: str):
        if stored is not UNQUANTIZED and not hasattr(stored, "dequantize"):
            raise QuantizationError(
                f"{why} needs a plain weight, and {stored.name} weights cannot be dequantized at load; "
                "use a checkpoint that stores it in bf16, fp8 or a pack-quantized int format"
            )
        self.stored = stored
        self.name = stored.name if stored is UNQUANTIZED else f"{stored.name} dequantized at load ({why})"

    def create_weights(self, layer: nn.Module, shards: LinearShards, dtype: torch.dtype) -> None:
        self.stored.create_weights(layer, shards, dtype)
        layer.run_dtype = dtype

    def checkpoint_slots(self, layer: nn.Module, part: int) -> dict[str, ShardSlot]:
        return self.stored.checkpoint_slots(layer, part)

    def process_weights(self, layer: nn.Module) -> None:
        if self.stored is UNQUANTIZED:
            return
        self.stored.process_weights(layer)
        weight = self.stored.dequantize(layer).to(layer.run_dtype)
        for name in [n for n in layer._parameters if n != "bias"]:
            delattr(layer, name)
        for name in [n for n in layer._modules if isinstance(layer._modules[n], nn.ParameterList)]:
            delattr(layer, name)
        layer.__dict__.pop("reference_weight", None)
        layer.weight = nn.Parameter(weight, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias)
