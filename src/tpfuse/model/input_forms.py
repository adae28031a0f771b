"""Input forms: a projection's input written by the kernel that produces it, in the form the
projection's kernel reads, so that no launch and no program of the product converts it again.

A linear method may ask for one (its input_form(layer, rows), where start-up timing in
model/linear_choice.py found the product on that form faster than on the plain tensor); the
producer, the fused all-reduce + residual add + RMSNorm before the projection or the SiLU-and-mul
inside a gated MLP, then writes it through the form's fused_norm / silu_and_mul. A producer without a
kernel for the form gives the plain tensor, which every method also takes, so a form is an
optimization and never a requirement.

  - Fp8RowsForm(group): e4m3 rows with one scale a `group` columns (kernels/fp8_rows.py), what the
    FP8 W8A8 prefill product quantizes its input to; written by the norms at every tensor-parallel
    size (the all-reduce kernels' FP8-rows epilogue).
  - Half2XForm: one row as the f16x2 INT4 GEMV's operands (kernels/quant_int_half2.py's Half2X);
    written by the norms at every tensor-parallel size (the all-reduce kernels' Half2X epilogue) and
    by SiLU-and-mul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from tpfuse.comm.communicator import Communicator
from tpfuse.kernels import quantize_fp8_rows, silu_and_mul, silu_and_mul_half2x
from tpfuse.kernels.fp8_rows import Fp8Rows
from tpfuse.kernels.quant_int_half2 import Half2X, half2_x, holds


class InputForm(Protocol):
    """make(x [T, K]) -> x in the form (what a producer's kernel writes; start-up timing and tests);
    fused_norm(comm, x, residual, weight, eps) -> (the normed rows in the form or plain, new residual);
    silu_and_mul(x [T, 2 I]) -> silu(gate) * up in the form or plain."""

    def make(self, x: torch.Tensor): ...

    def fused_norm(self, comm: Communicator, x, residual, weight, eps: float): ...

    def silu_and_mul(self, x: torch.Tensor): ...


@dataclass(frozen=True)
class Fp8RowsForm:
    """FP8 rows of `group` columns a scale (the whole row, or kernels/fp8_rows.py's BLOCK_GROUP)."""

    group: int

    def make(self, x: torch.Tensor) -> Fp8Rows:
        data, scales = quantize_fp8_rows(x, self.group)
        return Fp8Rows(data, scales, x.dtype, self.group)

    def fused_norm(self, comm: Communicator, x, residual, weight, eps: float):
        return comm.fused_add_rmsnorm_all_reduce_fp8_rows(x, residual, weight, eps, self.group)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)  # no SiLU-and-mul kernel writes FP8 rows: the plain tensor


@dataclass(frozen=True)
class Half2XForm:
    """One bf16 / fp16 row as Half2X (kernels/quant_int_half2.py); more rows stay plain."""

    def make(self, x: torch.Tensor) -> Half2X | torch.Tensor:
        return half2_x(x) if holds(*x.shape, x.dtype) else x

    def fused_norm(self, comm: Communicator, x, residual, weight, eps: float):
        if holds(*x.shape, x.dtype):
            return comm.fused_add_rmsnorm_all_reduce_half2x(x, residual, weight, eps)
        return comm.fused_add_rmsnorm_all_reduce(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> Half2X | torch.Tensor:
        if x.shape[1] % 2 == 0 and holds(x.shape[0], x.shape[1] // 2, x.dtype):
            return silu_and_mul_half2x(x)
        return silu_and_mul(x)


HALF2X = Half2XForm()


def input_form(layer: nn.Module, rows: int) -> InputForm | None:
    """The form the projection `layer` takes its input in at `rows` rows: its method's input_form where
    it has one, else None (the plain tensor)."""
    method = getattr(layer, "method", None)
    return method.input_form(layer, rows) if hasattr(method, "input_form") else None


def silu_and_mul_as(x: torch.Tensor, form: InputForm | None = None):
    """silu(gate) * up of x [T, 2 I], in `form` where given and it has a kernel for it (else plain)."""
    return form.silu_and_mul(x) if form is not None else silu_and_mul(x)


def fused_norm(comm: Communicator, x, residual, weight, eps: float, form: InputForm | None = None):
    """comm's all-reduce + residual add + RMSNorm of x: (normed, new residual), normed in `form` where
    given and the communicator writes it (else the plain tensor)."""
    if form is not None:
        return form.fused_norm(comm, x, residual, weight, eps)
    return comm.fused_add_rmsnorm_all_reduce(x, residual, weight, eps)
