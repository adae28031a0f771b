"""The all-reduce schedules tpfuse's kernels offer, one Schedule each: how to launch it, how many
interpreter steps it has, what it needs of the workspace and what traffic it puts on the links.

The plan (plan.py / tuning.py) races the available schedules against the fallback per size bucket;
the link probe (link_probe.py) removes the ones whose traffic pattern the links punish.

Traffic patterns (what the probe's findings act on):
- "fan-out writes": a rank writes to many peers at once (one-shot, two-shot, and the hierarchical
  schedule inside an island), hurt by write collapse;
- "one write stream": one outbound and one inbound stream at a time (staged; ordered_push as long as
  the ranks run at equal speed);
- "reads": peers' buffers are read, no peer data stores (pull), hurt by read collapse, immune to
  peer stores routed through system memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from tpfuse.comm import allreduce as k
from tpfuse.comm import allreduce_pcie as p
from tpfuse.comm.workspace import RankWorkspace

NO_GATHER = (1, 0, 0)  # one_shot_kernel's gather layout arguments, unused by the all-reduce epilogues
FAN_OUT_WRITES, ONE_WRITE_STREAM, READS = "fan-out writes", "one write stream", "reads"


@dataclass(frozen=True)
class Schedule:
    name: str
    traffic: str  # FAN_OUT_WRITES, ONE_WRITE_STREAM or READS
    summary: str
    launch: Callable  # (ws, grid, meta, tensors, num_rows, hidden, eps, epilogue, phases) -> None
    steps: Callable[[int], int]  # world size -> interpreter steps (phase mask bits)
    partial_bytes: int = 0  # bytes per element a slot must hold besides the message (0: message only)
    needs_islands: bool = False

    def slot_bytes_needed(self, numel: int, itemsize: int) -> int:
        return numel * max(itemsize, self.partial_bytes)

    def available(self, ws: RankWorkspace) -> str | None:
        """Why this schedule cannot run on ws (None: it can)."""
        if self.needs_islands and (ws.islands is None or len(ws.islands) < 2):
            return "needs two or more islands (topology or --allreduce-islands)"
        return None


def _one_shot(ws, grid, meta, tensors, num_rows, hidden, eps, epilogue, phases):
    lay, block = ws.layout, triton.next_power_of_2(hidden)
    k.one_shot_kernel[grid](
        *tensors, ws.rank, num_rows, hidden, eps, ws.timeout_for_kernel(meta["INTERPRET"]), lay.flag_off,
        lay.data_off, lay.slot_bytes, lay.max_programs, *NO_GATHER, BLOCK=block, EPILOGUE=epilogue,
        PHASES=phases, num_warps=k.num_warps_for(block), **meta,
    )  # fmt: skip


def _two_shot(ws, grid, meta, tensors, num_rows, hidden, eps, epilogue, phases):
    lay, block = ws.layout, triton.next_power_of_2(hidden)
    chunk = (hidden + ws.world_size - 1) // ws.world_size
    chunk = (chunk + 7) // 8 * 8  # 16-byte aligned chunks where the hidden size allows
    k.two_shot_kernel[grid](
        *tensors, ws.rank, num_rows, hidden, chunk, eps, ws.timeout_for_kernel(meta["INTERPRET"]),
        lay.flag_off, lay.data_off, lay.gather_off, lay.slot_bytes, lay.max_programs, BLOCK=block,
        CHUNK_BLOCK=triton.next_power_of_2(chunk), EPILOGUE=epilogue, PHASES=phases,
        num_warps=k.num_warps_for(block), **meta,
    )  # fmt: skip


def _pcie(kernel, with_plan: bool, **constexprs):
    def launch(ws, grid, meta, tensors, num_rows, hidden, eps, epilogue, phases):
        lay, block = ws.layout, triton.next_power_of_2(hidden)
        plan = (ws.island_plan,) if with_plan else ()
        kernel[grid](
            *tensors, *plan, ws.rank, num_rows, hidden, eps, ws.timeout_for_kernel(meta["INTERPRET"]),
            lay.flag_off, lay.data_off, lay.slot_bytes, lay.max_programs, BLOCK=block, EPILOGUE=epilogue,
            PHASES=phases, num_warps=k.num_warps_for(block), **constexprs, **meta,
        )  # fmt: skip

    return launch


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule("one_shot", FAN_OUT_WRITES, "every rank writes its rows to every rank, sums locally",
                 _one_shot, lambda ws: 3),
        Schedule("two_shot", FAN_OUT_WRITES, "reduce-scatter by columns, then all-gather of the sums",
                 _two_shot, lambda ws: 3),
        Schedule("staged", ONE_WRITE_STREAM, "ring-ordered stages: one peer written and one heard per stage",
                 _pcie(p.staged_kernel, False, LOCKSTEP=True), lambda ws: 2 * (ws - 1) + 1),
        Schedule("ordered_push", ONE_WRITE_STREAM, "the staged pushes in ring order, one wait at the end",
                 _pcie(p.staged_kernel, False, LOCKSTEP=False), lambda ws: 2 * (ws - 1) + 1),
        Schedule("hierarchical", FAN_OUT_WRITES,
                 "one-shot inside each island, float32 island partials exchanged between islands",
                 _pcie(p.hierarchical_kernel, True), lambda ws: 3, partial_bytes=4, needs_islands=True),
        Schedule("pull", READS, "every rank publishes its rows locally and reads every peer's",
                 _pcie(p.pull_kernel, False), lambda ws: 2),
    )
}  # fmt: skip
ALGORITHMS = tuple(SCHEDULES)


def get(name: str) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown all-reduce algorithm {name!r}; choose one of {ALGORITHMS}")
    return SCHEDULES[name]


def fits(ws: RankWorkspace, x: torch.Tensor, name: str = "one_shot") -> bool:
    """Whether x (any shape) fits one slot of ws for schedule `name`."""
    return get(name).slot_bytes_needed(x.numel(), x.element_size()) <= ws.layout.slot_bytes


def available(ws: RankWorkspace, names=ALGORITHMS) -> list[str]:
    """The schedules of `names` that can run on ws, in order."""
    return [n for n in names if get(n).available(ws) is None]
