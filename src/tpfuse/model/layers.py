"""Tensor-parallel layers: column/row-parallel linear, vocab-parallel embedding and lm_head, RMSNorm.

Every layer knows which part of each checkpoint tensor this rank holds: `slot()` (norms,
embeddings) or `checkpoint_slots(names)` (linears, whose tensors their LinearMethod names) return
ShardSlots, which the loader uses to read only that range from disk (safetensors get_slice) and copy
it into place. Row-parallel layers return partial sums; the all-reduce happens in the Communicator's
fused all-reduce + residual + RMSNorm, never inside a layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpfuse.comm.communicator import Communicator
from tpfuse.kernels import rmsnorm_op
from tpfuse.model.linear_method import UNQUANTIZED, LinearMethod, LinearShards, linear, method_for
from tpfuse.model.shard import ShardSlot, empty_parameter


class Linear(nn.Linear):
    """nn.Linear (its parameter names and layout) that runs through the unquantized routes: for
    modules outside the tensor-parallel layers below, such as an EAGLE-3 head."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def projections(model: nn.Module) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """(weight, bias) of every unquantized linear map of the model, lm_head included (the inputs
    of model/linear_choice.py's start-up measurement)."""
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear | ParallelLMHead):
            if module.method is UNQUANTIZED:
                yield module.weight, getattr(module, "bias", None)
        elif isinstance(module, Linear):
            yield module.weight, module.bias


@dataclass
class ParallelContext:
    tp_rank: int
    tp_size: int
    comm: Communicator


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(
            f"{what} ({total}) is not divisible by --tp-size {parts}; choose a tp size that divides it"
        )
    return total // parts


class ColumnParallelLinear(nn.Module):
    """y = x @ W.T (+ b) with W's output rows split over ranks; several checkpoint tensors ("parts",
    e.g. gate and up) may be merged into one weight, each sharded separately. The weights and
    their checkpoint tensors are the method's (model/linear_method.py; default: the quantization
    the model is built with).

    part_ranges: per part (full_size, start, local_size) of the rows this rank holds; by default
    each part is split evenly. x: [T, input_size] -> [T, sum(local sizes)], the rank's slice.
    """

    def __init__(
        self,
        input_size: int,
        part_sizes: list[int],
        parallel: ParallelContext,
        dtype: torch.dtype,
        bias: bool = False,
        part_ranges: list[tuple[int, int, int]] | None = None,
        method: LinearMethod | None = None,
    ):
        super().__init__()
        if part_ranges is None:
            part_ranges = []
            for size in part_sizes:
                local = divide(size, parallel.tp_size, "a column-parallel output size")
                part_ranges.append((size, parallel.tp_rank * local, local))
        self.input_size = input_size
        self.part_ranges = part_ranges
        self.local_sizes = [local for _, _, local in part_ranges]
        self.shards = LinearShards(tuple(part_ranges), input_size)
        self.method = method or method_for("column")
        self.method.create_weights(self, self.shards, dtype)
        self.bias = empty_parameter(sum(self.local_sizes), dtype=dtype) if bias else None

    def slot(self, part: int = 0, bias: bool = False) -> ShardSlot:
        """The slot of one part's weight (or bias); checkpoint_slots names every tensor of a method."""
        if bias:
            full, start, local = self.part_ranges[part]
            return ShardSlot(self.bias, (full,), 0, start, local, self.shards.row_offset(part))
        return self.method.checkpoint_slots(self, part)["weight"]

    def checkpoint_slots(self, names: list[str]) -> dict[str, ShardSlot]:
        """names: the checkpoint prefix of each part, e.g. ["model.layers.0.mlp.gate_proj", ...] ->
        {"<name>.<tensor>": slot} for every tensor of every part (weights, scales, bias)."""
        self.checkpoint_names = list(names)
        slots = {}
        for part, name in enumerate(names):
            for suffix, slot in self.method.checkpoint_slots(self, part).items():
                slots[f"{name}.{suffix}"] = slot
            if self.bias is not None:
                slots[f"{name}.bias"] = self.slot(part, bias=True)
        return slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections merged; query heads split over ranks. With fewer kv heads than ranks
    each rank keeps the one kv head its query heads use (tp must then be a multiple of num_kv_heads)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        bias: bool = False,
        method: LinearMethod | None = None,
    ):
        tp, rank = parallel.tp_size, parallel.tp_rank
        self.num_heads_local = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads_local = divide(num_kv_heads, tp, "num_key_value_heads")
            kv_head_start = rank * self.num_kv_heads_local
        else:
            if tp % num_kv_heads:
                raise ValueError(
                    f"--tp-size {tp} exceeds num_key_value_heads ({num_kv_heads}) and is not a multiple "
                    "of it, so kv heads cannot be replicated evenly; choose a tp size dividing or "
                    "divisible by the number of kv heads"
                )
            self.num_kv_heads_local = 1
            kv_head_start = rank // (tp // num_kv_heads)
        q_full, kv_full = num_heads * head_dim, num_kv_heads * head_dim
        q_local, kv_local = self.num_heads_local * head_dim, self.num_kv_heads_local * head_dim
        kv_range = (kv_full, kv_head_start * head_dim, kv_local)
        ranges = [(q_full, rank * q_local, q_local), kv_range, kv_range]
        super().__init__(hidden_size, [q_full, kv_full, kv_full], parallel, dtype, bias, ranges, method)


class RowParallelLinear(nn.Module):
    """y_partial = x_local @ W_local.T with W's input columns split over ranks; the weights are the
    method's, as in ColumnParallelLinear.

    x: [T, input_size / tp] -> [T, output_size], this rank's partial sum (not all-reduced).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        method: LinearMethod | None = None,
    ):
        super().__init__()
        self.local_input = divide(input_size, parallel.tp_size, "a row-parallel input size")
        self.start = parallel.tp_rank * self.local_input
        self.full_shape = (output_size, input_size)
        self.shards = LinearShards(((output_size, 0, output_size),), input_size, self.start, self.local_input)
        self.method = method or method_for("row")
        self.method.create_weights(self, self.shards, dtype)

    def slot(self) -> ShardSlot:
        """The slot of the weight; checkpoint_slots names every tensor of a method."""
        return self.method.checkpoint_slots(self, 0)["weight"]

    def checkpoint_slots(self, name: str) -> dict[str, ShardSlot]:
        """name: the checkpoint prefix, e.g. "model.layers.0.mlp.down_proj" -> {"<name>.<tensor>": slot}."""
        self.checkpoint_names = [name]
        return {f"{name}.{suffix}": slot for suffix, slot in self.method.checkpoint_slots(self, 0).items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, None)


class VocabParallelEmbedding(nn.Module):
    """Rows of the embedding table split over ranks; the vocabulary is padded up to a multiple of tp
    (padding rows are zero). forward returns this rank's partial sum: rows of ids outside the shard
    are zero, so the all-reduce (done by the caller's fused op) yields the full embedding.
    """

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext, dtype: torch.dtype):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = parallel.tp_size
        self.rows_per_rank = -(-vocab_size // parallel.tp_size)
        self.start = parallel.tp_rank * self.rows_per_rank
        self.num_valid_rows = max(0, min(self.rows_per_rank, vocab_size - self.start))
        self.weight = empty_parameter(self.rows_per_rank, hidden_size, dtype=dtype)
        self.weight.data[self.num_valid_rows :].zero_()

    def slot(self) -> ShardSlot:
        padding = self.rows_per_rank - self.num_valid_rows
        shape = (self.vocab_size, self.weight.shape[1])
        return ShardSlot(self.weight, shape, 0, self.start, self.num_valid_rows, zero_rows=padding)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] int64 -> [T, hidden] of the weight dtype (a partial sum when tp > 1)."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.start) & (input_ids < self.start + self.rows_per_rank)
        local_ids = torch.where(in_shard, input_ids - self.start, 0)
        return F.embedding(local_ids, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary on every rank: each rank multiplies by its rows of the output
    embedding (same padded row layout as the input embedding), then comm.all_gather joins them.
    tied_to: share that embedding's weight (tie_word_embeddings)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        tied_to: VocabParallelEmbedding | None = None,
    ):
        if tied_to is None:
            super().__init__(vocab_size, hidden_size, parallel, dtype)
        else:
            nn.Module.__init__(self)
            for name in ("vocab_size", "tp_size", "rows_per_rank", "start", "num_valid_rows"):
                setattr(self, name, getattr(tied_to, name))
            self.weight = tied_to.weight
        self.tied = tied_to is not None
        self.comm = parallel.comm
        self.method = UNQUANTIZED

    def forward(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, H] -> [N, vocab_size] float32, identical on every rank. out: an [N, vocab_size]
        float32 tensor to write them into (a CUDA graph's static buffer: no extra copy)."""
        logits = linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = self.comm.all_gather(logits, dim=-1)
        if out is None:
            return logits[:, : self.vocab_size].float()
        return out.copy_(logits[:, : self.vocab_size])


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(hidden_size, dtype=dtype)

    def slot(self) -> ShardSlot:
        return ShardSlot(self.weight, tuple(self.weight.shape), 0, 0, self.weight.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden] -> new [N, hidden]."""
        return rmsnorm_op(x, self.weight, self.eps)
