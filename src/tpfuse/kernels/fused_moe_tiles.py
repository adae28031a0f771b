"""Launch configurations of the fused-MoE expert products and the ones chosen at start-up.

model/moe_choice.py times the candidates per expert weight shape and power-of-two bucket of T * k
slots and records the fastest here (set_tile); kernels/fused_moe.py asks tile_for at each call.
Nothing is recorded on CPU: the defaults run under the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton


@dataclass(frozen=True)
class MoeTile:
    """Launch configuration of both expert products: block_m rows of one expert per program (16:
    decode, the MMA minimum; 64-128: prefill), block_n output and block_k reduction columns.
    block_m = 1 is the per-slot GEMV route: no grouping, one (token, slot) row per program, its
    expert's weight tile streamed with multiply-adds (few tokens, each slot a distinct expert). There
    the two products may take different shapes: down, the (block_n, block_k, num_warps) of the down
    product where start-up timing found one faster than the gate/up product's (its K is the
    intermediate size, not the hidden size); None: the same as gate/up."""

    block_m: int
    block_n: int
    block_k: int
    num_stages: int = 3
    num_warps: int = 4
    down: tuple[int, int, int] | None = field(default=None, kw_only=True)  # subclasses add positionals

    def down_shape(self) -> tuple[int, int, int]:
        """(block_n, block_k, num_warps) of the per-slot down product."""
        return self.down or (self.block_n, self.block_k, self.num_warps)

    def label(self) -> str:
        kind = "slot gemv " if self.block_m == 1 else f"moe {self.block_m}x"
        down = f", down {self.down[0]}x{self.down[1]} w{self.down[2]}" if self.down else ""
        return f"{kind}{self.block_n}x{self.block_k} s{self.num_stages} w{self.num_warps}{down}"


DEFAULT_DECODE_TILE = MoeTile(16, 64, 128, 4, 4)
DEFAULT_PREFILL_TILE = MoeTile(64, 128, 64, 3, 4)
DECODE_MAX_SLOTS = 64 * 8  # up to 64 tokens of top-8: the decode tiles, unless measured otherwise
# What model/moe_choice.py times at start-up (the defaults first): decode tiles stream each routed
# expert's weights once with few rows; prefill tiles are tensor-core GEMM tiles.
DECODE_TILES = (
    DEFAULT_DECODE_TILE,
    MoeTile(1, 32, 256, 2, 4),
    MoeTile(1, 16, 512, 2, 4),
    MoeTile(1, 64, 128, 2, 4),
    MoeTile(1, 16, 256, 2, 4),
    MoeTile(1, 8, 512, 2, 4),
    MoeTile(1, 32, 256, 2, 8),
    MoeTile(16, 32, 128, 4, 4),
    MoeTile(16, 128, 64, 4, 4),
    MoeTile(16, 64, 256, 3, 8),
    MoeTile(32, 64, 128, 3, 4),
)
# Shapes start-up timing tries for the per-slot down product alone, once the joint tile is a slot
# tile: (block_n, block_k, num_warps).
SLOT_DOWN_SHAPES = ((16, 256, 4), (32, 256, 4), (64, 256, 8), (16, 512, 4), (32, 512, 8), (64, 128, 4),
                    (128, 128, 8))  # fmt: skip
PREFILL_TILES = (
    DEFAULT_PREFILL_TILE,
    MoeTile(64, 64, 64, 4, 4),
    MoeTile(128, 128, 64, 3, 8),
    MoeTile(128, 64, 64, 4, 4),
    MoeTile(64, 128, 128, 2, 8),
)
CANDIDATE_TILES = DECODE_TILES + PREFILL_TILES[1:]


def default_tile(num_slots: int) -> MoeTile:
    return DEFAULT_DECODE_TILE if num_slots <= DECODE_MAX_SLOTS else DEFAULT_PREFILL_TILE


_CHOSEN_TILES: dict[tuple, MoeTile] = {}


def set_tile(w13: torch.Tensor, slots_bucket: int, tile: MoeTile) -> None:
    """Records the measured tile of an expert weight shape at a slot-count bucket (model/moe_choice.py)."""
    _CHOSEN_TILES[(tuple(w13.shape), w13.dtype, w13.device, slots_bucket)] = tile


def slots_bucket(num_slots: int) -> int:
    """Power-of-two bucket of T * k: the key of a measured tile."""
    return triton.next_power_of_2(max(num_slots, 1))


def tile_for(w13: torch.Tensor, num_slots: int) -> MoeTile:
    key = (tuple(w13.shape), w13.dtype, w13.device, slots_bucket(num_slots))
    return _CHOSEN_TILES.get(key) or default_tile(num_slots)
