"""Triton all-reduce schedules for PCIe-class links: staged push, hierarchical over islands, pull.

Same protocol as allreduce.py (sync.py: push or publish, release flags, poll only local flags, device
epochs, bounded spins), the same persistent row split (program p of every rank handles rows p, p + G,
...), the same epilogues (sum; + residual, RMSNorm; + FP8). Sums run in float32 in a fixed order that
every rank shares, so every rank's outputs are bit-identical.

- staged: WS - 1 stages; in stage s rank r writes its rows into slot [r] of rank (r + s) % WS only and
  waits for the one rank (r - s) % WS that writes to it, so each GPU has one outbound and one inbound
  peer stream at a time. Then it sums the WS slots in rank order (its own rows straight from x).
  LOCKSTEP=False (the "ordered_push" schedule) keeps the ring order of the pushes but waits only once,
  for every peer, after the last stage: one flag round instead of WS - 1, the one-stream property is
  then only what equal speeds give.
- hierarchical: islands (plan table, islands.py) partition the ranks. (1) one-shot inside the island:
  every rank pushes its rows to its island peers and sums them into the island partial P (float32, rank
  order); (2) exchange: each rank pushes P, in float32, to its counterparts in the other islands; (3)
  every rank sums the islands' partials in island order. The float32 partial needs 4 bytes per element
  of slot (schedules.py checks it fits).
- pull: every rank copies its rows into its own slot and flags every peer; after all flags arrived it
  reads slot [s] of every peer s's buffer (remote loads) and sums in rank order.

Steps, for the interpreter (which runs each step on every rank before the next; on the GPU one launch
runs them all): staged 2 (WS - 1) + 1 (push, wait per stage, then reduce); hierarchical 3; pull 2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpfuse.comm.allreduce import NO_RANK_SPECIALIZATION, _finish_row, _launch_slots, _region, _slot
from tpfuse.comm.sync import FLAG_GATHER, FLAG_PUSH, finish_launch, signal_ranks, wait_for_sources

# plan table of the hierarchical schedule (int32, one per rank; islands.island_plan builds it)
PLAN_ISLAND = tl.constexpr(0)  # bitmask of this rank's island (itself included)
PLAN_SEND = tl.constexpr(1)  # bitmask of the ranks this rank sends its island partial to
PLAN_RECEIVE = tl.constexpr(2)  # bitmask of the ranks whose island partials this rank receives
PLAN_ORDER = tl.constexpr(3)  # [WS]: per island in order, the rank its partial comes from; -1 own, -2 none
OWN_ISLAND = tl.constexpr(-1)


@triton.jit
def _has_bit(cols, bits, j):
    """Whether bit j of the scalar `bits` is set, broadcast to the shape of cols (a row mask)."""
    return ((cols * 0 + (bits >> j)) & 1) == 1


@triton.jit
def _slot_or_own(peer_table, owner, slot, s, rank, x_ptr, row, hidden, cols, mask, DT: tl.constexpr):
    """Row `row` of source s as float32: from x when s is this rank, else from slot of owner's buffer."""
    src = _region(peer_table, owner, slot, DT) + row * hidden + cols
    own = (cols * 0 + rank) == s
    remote = tl.load(src, mask=mask & (own == 0), other=0.0, volatile=True)
    local = tl.load(x_ptr + row * hidden + cols, mask=mask & own, other=0.0)
    return tl.where(own, local, remote).to(tl.float32)


@triton.jit
def _sum_ranks(peer_table, rank, x_ptr, row, hidden, cols, in_row, data_off, parity, slot_bytes,
               WS: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr, PULL: tl.constexpr):  # fmt: skip
    """Every rank's row summed in float32 in rank order, this rank's own from x; the others from slot [s]
    of this rank's buffer (pushed to it), or with PULL of rank s's own buffer (remote loads)."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(WS):
        slot = _slot(data_off, parity, s, slot_bytes, WS)
        if PULL:
            acc += _slot_or_own(peer_table, s, slot, s, rank, x_ptr, row, hidden, cols, in_row, DT)
        else:
            acc += _slot_or_own(peer_table, rank, slot, s, rank, x_ptr, row, hidden, cols, in_row, DT)
    return acc


@triton.jit
def _copy_rows(x_ptr, dst, pid, nprog, num_rows, hidden, cols, in_row):
    """This program's rows of x (rows pid, pid + nprog, ...) into the same rows at dst."""
    for row in range(pid, num_rows, nprog):
        v = tl.load(x_ptr + row * hidden + cols, mask=in_row)
        tl.store(dst + row * hidden + cols, v, mask=in_row)


@triton.jit
def _push_row_to(peer_table, targets, slot, row, hidden, cols, v, in_row, WS: tl.constexpr, DT: tl.constexpr):
    """Store v as row `row` of `slot` in the buffers of the ranks in the bitmask `targets` only."""
    for j in tl.static_range(WS):
        to_j = in_row & _has_bit(cols, targets, j)
        tl.store(_region(peer_table, j, slot, DT) + row * hidden + cols, v, mask=to_j)


@triton.jit(do_not_specialize=NO_RANK_SPECIALIZATION)
def staged_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr,
                  peer_table, buffer_ptr, rank, num_rows, hidden, eps, timeout,
                  flag_off, data_off, slot_bytes, max_programs,
                  WS: tl.constexpr, WS_P2: tl.constexpr, BLOCK: tl.constexpr, EPILOGUE: tl.constexpr,
                  PHASES: tl.constexpr, INTERPRET: tl.constexpr, LOCKSTEP: tl.constexpr):  # fmt: skip
    """x: [num_rows, hidden] contiguous; out as launch.py's epilogue contract."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch, parity = _launch_slots(buffer_ptr)
    cols = tl.arange(0, BLOCK)
    in_row = cols < hidden
    one = rank * 0 + 1
    own_slot = _slot(data_off, parity, rank, slot_bytes, WS)
    for stage in tl.static_range(1, WS):
        if (PHASES >> (2 * stage - 2)) & 1:
            target = (rank + stage) % WS
            dst = _region(peer_table, target, own_slot, DT)
            _copy_rows(x_ptr, dst, pid, nprog, num_rows, hidden, cols, in_row)
            signal_ranks(peer_table, rank, epoch, FLAG_PUSH, flag_off, max_programs, one << target,
                         WS, WS_P2, INTERPRET)  # fmt: skip
        if LOCKSTEP and (PHASES >> (2 * stage - 1)) & 1:
            source = (rank + WS - stage) % WS
            wait_for_sources(peer_table, buffer_ptr, rank, epoch, FLAG_PUSH, flag_off, max_programs, timeout,
                             one << source, WS, WS_P2, INTERPRET)  # fmt: skip
    if (PHASES >> (2 * WS - 2)) & 1:
        if not LOCKSTEP:
            others = (one << WS) - 1 - (one << rank)
            wait_for_sources(peer_table, buffer_ptr, rank, epoch, FLAG_PUSH, flag_off, max_programs, timeout,
                             others, WS, WS_P2, INTERPRET)  # fmt: skip
        for row in range(pid, num_rows, nprog):
            acc = _sum_ranks(peer_table, rank, x_ptr, row, hidden, cols, in_row, data_off, parity, slot_bytes,
                             WS, BLOCK, DT, PULL=False)  # fmt: skip
            _finish_row(acc, row, cols, in_row, hidden, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                        scale_ptr, eps, DT, EPILOGUE)  # fmt: skip
        finish_launch(buffer_ptr, epoch)


@triton.jit(do_not_specialize=NO_RANK_SPECIALIZATION)
def pull_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr,
                peer_table, buffer_ptr, rank, num_rows, hidden, eps, timeout,
                flag_off, data_off, slot_bytes, max_programs,
                WS: tl.constexpr, WS_P2: tl.constexpr, BLOCK: tl.constexpr, EPILOGUE: tl.constexpr,
                PHASES: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """x: [num_rows, hidden] contiguous. Rank s's rows are read from slot [s] of rank s's own buffer."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch, parity = _launch_slots(buffer_ptr)
    cols = tl.arange(0, BLOCK)
    in_row = cols < hidden
    others = ((rank * 0 + 1) << WS) - 1 - ((rank * 0 + 1) << rank)
    if PHASES & 1:
        dst = _region(peer_table, rank, _slot(data_off, parity, rank, slot_bytes, WS), DT)
        _copy_rows(x_ptr, dst, pid, nprog, num_rows, hidden, cols, in_row)
        signal_ranks(peer_table, rank, epoch, FLAG_PUSH, flag_off, max_programs, others, WS, WS_P2, INTERPRET)
    if PHASES & 2:
        wait_for_sources(peer_table, buffer_ptr, rank, epoch, FLAG_PUSH, flag_off, max_programs, timeout,
                         others, WS, WS_P2, INTERPRET)  # fmt: skip
        for row in range(pid, num_rows, nprog):
            acc = _sum_ranks(peer_table, rank, x_ptr, row, hidden, cols, in_row, data_off, parity, slot_bytes,
                             WS, BLOCK, DT, PULL=True)  # fmt: skip
            _finish_row(acc, row, cols, in_row, hidden, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                        scale_ptr, eps, DT, EPILOGUE)  # fmt: skip
        finish_launch(buffer_ptr, epoch)


@triton.jit
def _island_partial(peer_table, island, rank, x_ptr, row, hidden, cols, in_row, data_off, parity, slot_bytes,
                    WS: tl.constexpr, BLOCK: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """The island's float32 partial of one row: its members' rows summed in rank order."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(WS):
        member = _has_bit(cols, island, s)
        v = _slot_or_own(peer_table, rank, _slot(data_off, parity, s, slot_bytes, WS), s, rank, x_ptr, row,
                         hidden, cols, in_row & member, DT)  # fmt: skip
        acc += tl.where(member, v, 0.0)
    return acc


@triton.jit(do_not_specialize=NO_RANK_SPECIALIZATION)
def hierarchical_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr,
                        peer_table, buffer_ptr, plan_ptr, rank, num_rows, hidden, eps, timeout,
                        flag_off, data_off, slot_bytes, max_programs,
                        WS: tl.constexpr, WS_P2: tl.constexpr, BLOCK: tl.constexpr, EPILOGUE: tl.constexpr,
                        PHASES: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """x: [num_rows, hidden] contiguous; plan_ptr: this rank's int32 plan table (PLAN_* above)."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch, parity = _launch_slots(buffer_ptr)
    cols = tl.arange(0, BLOCK)
    in_row = cols < hidden
    island = tl.load(plan_ptr + PLAN_ISLAND)
    peers = island & ~((rank * 0 + 1) << rank)
    own_slot = _slot(data_off, parity, rank, slot_bytes, WS)
    if PHASES & 1:
        for row in range(pid, num_rows, nprog):
            v = tl.load(x_ptr + row * hidden + cols, mask=in_row)
            _push_row_to(peer_table, peers, own_slot, row, hidden, cols, v, in_row, WS, DT)
        signal_ranks(peer_table, rank, epoch, FLAG_PUSH, flag_off, max_programs, peers, WS, WS_P2, INTERPRET)
    if PHASES & 2:
        wait_for_sources(peer_table, buffer_ptr, rank, epoch, FLAG_PUSH, flag_off, max_programs, timeout,
                         peers, WS, WS_P2, INTERPRET)  # fmt: skip
        send = tl.load(plan_ptr + PLAN_SEND)
        for row in range(pid, num_rows, nprog):
            partial = _island_partial(peer_table, island, rank, x_ptr, row, hidden, cols, in_row, data_off,
                                      parity, slot_bytes, WS, BLOCK, DT)  # fmt: skip
            _push_row_to(peer_table, send, own_slot, row, hidden, cols, partial, in_row, WS, tl.float32)
        signal_ranks(peer_table, rank, epoch, FLAG_GATHER, flag_off, max_programs, send, WS, WS_P2, INTERPRET)
    if PHASES & 4:
        wait_for_sources(peer_table, buffer_ptr, rank, epoch, FLAG_GATHER, flag_off, max_programs, timeout,
                         tl.load(plan_ptr + PLAN_RECEIVE), WS, WS_P2, INTERPRET)  # fmt: skip
        for row in range(pid, num_rows, nprog):
            partial = _island_partial(peer_table, island, rank, x_ptr, row, hidden, cols, in_row, data_off,
                                      parity, slot_bytes, WS, BLOCK, DT)  # fmt: skip
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for k in tl.static_range(WS):
                source = tl.load(plan_ptr + PLAN_ORDER + k)
                remote = (cols * 0 + source) >= 0
                their_slot = _slot(data_off, parity, tl.maximum(source, 0), slot_bytes, WS)
                src = _region(peer_table, rank, their_slot, tl.float32)
                theirs = tl.load(src + row * hidden + cols, mask=in_row & remote, other=0.0, volatile=True)
                acc += tl.where((cols * 0 + source) == OWN_ISLAND, partial, theirs)
            _finish_row(acc, row, cols, in_row, hidden, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                        scale_ptr, eps, DT, EPILOGUE)  # fmt: skip
        finish_launch(buffer_ptr, epoch)
