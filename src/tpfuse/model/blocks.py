"""Blocks the decoder families share: the feed-forward contract, the gated MLP and the decoder layer.

A feed-forward block (GatedMLP here, SparseMoeBlock in model/moe.py) is a FeedForwardBlock:
`forward_add_rmsnorm(h, residual, weight, eps, comm) -> (normed, new_residual)` ends the layer, its
output summed over ranks into the residual stream and normed by `weight` (the next layer's input
norm); `forward_after_attention` starts one step earlier, from the attention's partial sum (the
post-attention all-reduce + add + RMSNorm first); `checkpoint_slots(prefix)` names its checkpoint
tensors. So a block may fuse its own prologue (the MoE router) and epilogue (the MoE combine) into
the neighbouring syncs without the decoder loop knowing. form asks a block to write the next norm's
output in that input form (model/input_forms.py) because its consumer takes it (input_form); a block
that cannot gives the plain tensor, which every consumer also takes.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch
from torch import nn

from tpfuse.comm.communicator import Communicator
from tpfuse.model.attention import Attention
from tpfuse.model.config import ModelConfig
from tpfuse.model.input_forms import InputForm, fused_norm, input_form, silu_and_mul_as
from tpfuse.model.layers import ColumnParallelLinear, ParallelContext, RMSNorm, RowParallelLinear, ShardSlot
from tpfuse.model.linear_method import method_for


class FeedForwardBlock(nn.Module, abc.ABC):
    """The feed-forward half of a decoder layer (the module docstring's contract)."""

    @abc.abstractmethod
    def forward_add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        comm: Communicator,
        form: InputForm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] normed -> (the next norm's output, the new residual), both [T, H] (the output in
        `form` where given and the block can)."""

    def input_form(self, num_tokens: int) -> InputForm | None:
        """The form the post-attention norm should write this block's input in; None (the plain
        tensor) unless a block's first projection takes one."""
        return None

    def forward_after_attention(
        self,
        partial: torch.Tensor,
        residual: torch.Tensor,
        post_weight: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        comm: Communicator,
        form: InputForm | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """From the attention's partial sum [T, H]: all-reduce + residual add + RMSNorm by post_weight
        (the post-attention norm), then forward_add_rmsnorm. A block overrides it to fuse that norm into
        its own first kernel."""
        h, residual = fused_norm(comm, partial, residual, post_weight, eps, self.input_form(partial.shape[0]))
        return self.forward_add_rmsnorm(h, residual, weight, eps, comm, form)


class GatedMLP(FeedForwardBlock):
    """down(silu(gate(x)) * up(x)), gate and up merged and split over ranks by rows, down by columns.

    names: the checkpoint's (gate, up, down) projection names, e.g. ("gate_proj", "up_proj", "down_proj"),
    also what the linears' methods are chosen by under a module_prefix (model/linear_method.py).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    ):
        super().__init__()
        i, (gate, up, down) = intermediate_size, names
        self.names = names
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [i, i], parallel, dtype, method=method_for("column", [gate, up])
        )
        self.down_proj = RowParallelLinear(i, hidden_size, parallel, dtype, method=method_for("row", [down]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] (or in input_form's form) -> [T, H], this rank's partial sum. The activation is
        written in the form down_proj takes (input_forms.silu_and_mul_as)."""
        gate_up = self.gate_up_proj(x)
        return self.down_proj(silu_and_mul_as(gate_up, input_form(self.down_proj, gate_up.shape[0])))

    def forward_add_rmsnorm(self, x, residual, weight, eps, comm, form=None):
        return fused_norm(comm, self(x), residual, weight, eps, form)

    def input_form(self, num_tokens: int) -> InputForm | None:
        return input_form(self.gate_up_proj, num_tokens)

    def checkpoint_slots(self, prefix: str) -> dict[str, ShardSlot]:
        gate, up, down = self.names
        slots = self.gate_up_proj.checkpoint_slots([prefix + gate, prefix + up])
        slots.update(self.down_proj.checkpoint_slots(prefix + down))
        return slots


class DecoderLayer(nn.Module):
    """input norm -> attention -> post-attention norm -> feed-forward block (make_ffn() builds it,
    after the attention, so shape errors come in that order; named ffn_name in the checkpoint: "mlp",
    or Mixtral's "block_sparse_moe"). The norms run in the decoder loop, fused with the all-reduces."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        make_ffn: Callable[[], nn.Module],
        ffn_name: str = "mlp",
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.self_attn = Attention(config, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.mlp = make_ffn()
        self.ffn_name = ffn_name

    def checkpoint_slots(self, prefix: str) -> dict[str, ShardSlot]:
        """prefix: e.g. "model.layers.3."."""
        slots = {
            prefix + "input_layernorm.weight": self.input_layernorm.slot(),
            prefix + "post_attention_layernorm.weight": self.post_attention_layernorm.slot(),
        }
        slots.update(self.self_attn.checkpoint_slots(prefix + "self_attn."))
        slots.update(self.mlp.checkpoint_slots(f"{prefix}{self.ffn_name}."))
        return slots
