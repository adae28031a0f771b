"""The linear-method seam: every parallel linear owns a LinearMethod that creates its parameters,
names its checkpoint tensors (each sharded the way its format needs) and computes the product.

UnquantizedLinearMethod is today's bf16/fp16/fp32 path: `linear` sends each input by its row count
to the route model/linear_choice.py measured fastest (the one-row GEMV, a few-row tile, or F.linear).
Quantized methods live in model/quant/, one file per format, chosen from the checkpoint's
quantization_config; the loader builds a model inside `linear_methods(config)` so the layers pick
them up without any model file knowing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tpfuse.kernels import gemv_op, skinny_linear_op
from tpfuse.model import linear_choice
from tpfuse.model.shard import ShardSlot, empty_parameter

ROLES = ("column", "row", "lm_head")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) by the route model/linear_choice.py measured fastest for this weight
    shape and x's row count: the one-row GEMV, a few-row Triton tile, or F.linear (cuBLAS on CUDA,
    and everything not chosen)."""
    route = linear_choice.route(x, weight, bias)
    if route is None:
        return F.linear(x, weight, bias)
    if route == linear_choice.GEMV:
        return gemv_op(x, weight, bias)
    return skinny_linear_op(x, weight, bias, tile=route)


@dataclass(frozen=True)
class LinearShards:
    """One rank's part of y = x @ W.T. parts: per merged checkpoint tensor (e.g. q, k, v) the
    (full rows, first row held, rows held); the rank's rows are the parts' in order. Input columns:
    (input_full, input_start, input_local): the whole K for column-parallel, a slice for row-parallel."""

    parts: tuple[tuple[int, int, int], ...]
    input_full: int
    input_start: int = 0
    input_local: int | None = None

    @property
    def k_local(self) -> int:
        return self.input_full if self.input_local is None else self.input_local

    @property
    def n_local(self) -> int:
        return sum(local for _, _, local in self.parts)

    @property
    def input_sharded(self) -> bool:
        return self.k_local != self.input_full

    def row_offset(self, part: int) -> int:
        return sum(local for _, _, local in self.parts[:part])


class LinearMethod(Protocol):
    """name: shown in the load log. create_weights registers the parameters on layer;
    checkpoint_slots(layer, part) -> {tensor suffix ("weight", "weight_scale", ...): ShardSlot};
    process_weights(layer) runs once after loading (repacking, expanding scales; raises ValueError
    naming the tensor whose values do not fit); apply(layer, x [T, K_local], bias) -> [T, N_local].
    Optional: input_form(layer, rows) -> model/input_forms.py's InputForm or None, the form its
    producer should write the input in (apply then also takes it), with form_candidates(layer, bucket)
    for model/linear_choice.py to time."""

    name: str

    def create_weights(self, layer: nn.Module, shards: LinearShards, dtype: torch.dtype) -> None: ...

    def checkpoint_slots(self, layer: nn.Module, part: int) -> dict[str, ShardSlot]: ...

    def process_weights(self, layer: nn.Module) -> None: ...

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class UnquantizedLinearMethod:
    """weight [N_local, K_local] of the run dtype, loaded from `weight` (float32/bf16/fp16 on disk)."""

    name = "unquantized"

    def create_weights(self, layer: nn.Module, shards: LinearShards, dtype: torch.dtype) -> None:
        layer.weight = empty_parameter(shards.n_local, shards.k_local, dtype=dtype)

    def checkpoint_slots(self, layer: nn.Module, part: int) -> dict[str, ShardSlot]:
        shards: LinearShards = layer.shards
        full, start, local = shards.parts[part]
        if shards.input_sharded:
            shape = (full, shards.input_full)
            return {"weight": ShardSlot(layer.weight, shape, 1, shards.input_start, shards.k_local)}
        shape = (full, shards.input_full)
        return {"weight": ShardSlot(layer.weight, shape, 0, start, local, shards.row_offset(part))}

    def process_weights(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()


class QuantConfig(Protocol):
    """A checkpoint's quantization (model/quant/): name for the load log; linear_method(role) for
    each role in ROLES (lm_head usually stays unquantized); expert_method() for MoE experts.
    A format that leaves some modules unquantized (an ignore list) also has
    linear_method_for(role, names) and expert_method_for(names): names are the checkpoint modules
    the linear (or the experts) hold, e.g. ("model.layers.0.self_attn.q_a_proj", ...)."""

    name: str

    def linear_method(self, role: str) -> LinearMethod: ...

    def expert_method(self):
        """The MoE experts' method (model/moe.py's ExpertMethod); raises for formats without one."""
        ...


_ACTIVE: list[QuantConfig | None] = [None]
_PREFIX: list[str | None] = [None]


@contextlib.contextmanager
def linear_methods(config: QuantConfig | None) -> Iterator[None]:
    """Layers built inside take their methods from config (None: unquantized)."""
    _ACTIVE.append(config)
    try:
        yield
    finally:
        _ACTIVE.pop()


@contextlib.contextmanager
def module_prefix(prefix: str) -> Iterator[None]:
    """Linears built inside name their checkpoint modules under prefix (nested prefixes join:
    "model.layers.3." then "self_attn."), so formats with per-module choices can make them.
    Outside any module_prefix a linear has no checkpoint name and takes the config's uniform method."""
    outer = _PREFIX[-1]
    _PREFIX.append(prefix if outer is None else outer + prefix)
    try:
        yield
    finally:
        _PREFIX.pop()


def _full_names(names: Sequence[str]) -> tuple[str, ...]:
    prefix = _PREFIX[-1]
    return () if prefix is None or not names else tuple(prefix + name for name in names)


def method_for(role: str, names: Sequence[str] = ()) -> LinearMethod:
    """The method of a linear built now, by role (column, row or lm_head). names: the checkpoint
    modules it holds, relative to the current module_prefix (merged parts: several)."""
    if role not in ROLES:
        raise ValueError(f"linear role {role!r} is not one of {ROLES}")
    config = _ACTIVE[-1]
    if config is None:
        return UNQUANTIZED
    full = _full_names(names)
    if full and hasattr(config, "linear_method_for"):
        return config.linear_method_for(role, full)
    return config.linear_method(role)


def reference_product(
    layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, dequantize
) -> torch.Tensor:
    """The torch reference path of a quantized method (CPU runs): x.float() @ W.T (+ bias) rounded
    once to x.dtype, where W = dequantize() [N, K] float32 is computed once per layer and kept."""
    weight = layer.__dict__.get("reference_weight")
    if weight is None:
        weight = dequantize()
        layer.__dict__["reference_weight"] = weight
    out = x.float() @ weight.T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def expert_method_for(names: Sequence[str] = ()):
    """The MoE experts' method of the quantization being built (None: unquantized experts). names:
    one expert's checkpoint modules (e.g. "experts.0.gate_proj", ...) relative to the module_prefix."""
    config = _ACTIVE[-1]
    if config is None:
        return None
    full = _full_names(names)
    if full and hasattr(config, "expert_method_for"):
        return config.expert_method_for(full)
    return config.expert_method()


def process_all(model: nn.Module) -> None:
    """Runs every method's process_weights (linears', experts') once, after the checkpoint is loaded."""
    for module in model.modules():
        process = getattr(getattr(module, "method", None), "process_weights", None)
        if process is not None:
            process(module)
