"""Device-side synchronisation for the peer-memory kernels: flags, bounded spins and epochs.

The protocol, in one place:
- Push, then poll only local memory. A rank writes its data into the peers' buffers with plain stores,
  then, after a CTA barrier, stores the call's epoch into its flag slot in each peer's buffer with a
  release store at system scope (`st.release.sys`). It then spins with acquire loads at system scope
  (`ld.acquire.sys`) on the flags in its own buffer. No remote atomics, no remote polling.
- Epochs live on the device. Each launch reads epoch = ctrl[EPOCH] + 1 at the start; the last program of
  the launch to finish publishes it back (a local atomic counts finished programs), so a captured CUDA
  graph advances the epoch on every replay. Epochs are uint32 and compared modulo 2^32: a flag has
  arrived when (flag - epoch) mod 2^32 < 2^31, so a peer that already moved on to the next call also
  counts as arrived (its earlier data happened-before its newer flag).
- Every spin is bounded by a timeout (nanoseconds of %globaltimer on the GPU). On timeout the missing
  ranks' bits are OR-ed into the local error word and the kernel carries on; the host reads the word
  (RankWorkspace.check) and raises an error naming the ranks.

INTERPRET (TRITON_INTERPRET=1, CPU tests) runs programs one after another, so nothing can wait for
anything: flags are plain loads and stores, and the timeout counts spin iterations instead of time.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Constants the kernels read are tl.constexpr (Triton's rule for globals); host code uses `.value`.
# int32 word offsets of the control block at the start of every rank's buffer (local use only)
CTRL_EPOCH = tl.constexpr(0)  # epoch of the last completed launch (uint32)
CTRL_DONE = tl.constexpr(1)  # programs of the running launch that have finished
CTRL_ERROR = tl.constexpr(2)  # bitmask of ranks whose flags never arrived (sticky)

# flag kinds: one flag array per protocol step, so steps never mistake each other's flags
FLAG_PUSH = tl.constexpr(0)  # one-shot data, two-shot scatter, all-gather data
FLAG_GATHER = tl.constexpr(1)  # two-shot: the reduced chunk has been pushed
NUM_FLAG_KINDS = 2

# launch phases; the GPU runs all of them in one launch, the interpreter one at a time across ranks.
# A phase mask has bit i for step i of a schedule (one-shot and two-shot name theirs below; the
# multi-step schedules of allreduce_pcie.py number theirs 0, 1, ...).
PHASE_PUSH = tl.constexpr(1)
PHASE_REDUCE = tl.constexpr(2)  # two-shot only: reduce own chunk and push it
PHASE_FINISH = tl.constexpr(4)
ALL_PHASES = (1 << 62) - 1

ARRIVED_WINDOW = tl.constexpr(0x80000000)


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: kernels run sequentially on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def store_release_sys(addresses, values, INTERPRET: tl.constexpr):
    """addresses: int64 byte addresses (any rank's memory); values: uint32, same shape."""
    if INTERPRET:
        tl.store(addresses.to(tl.pointer_type(tl.uint32)), values)
    else:
        tl.inline_asm_elementwise(
            "st.release.sys.global.u32 [$1], $2; mov.u32 $0, 0;",
            "=r,l,r",
            [addresses, values],
            dtype=tl.uint32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def load_acquire_sys(addresses, INTERPRET: tl.constexpr):
    """addresses: int64 byte addresses of this rank's own memory. Returns uint32."""
    if INTERPRET:
        return tl.load(addresses.to(tl.pointer_type(tl.uint32)))
    else:
        return tl.inline_asm_elementwise(
            "ld.acquire.sys.global.u32 $0, [$1];", "=r,l", [addresses], dtype=tl.uint32, is_pure=False, pack=1
        )


@triton.jit
def clock_ns(INTERPRET: tl.constexpr):
    """Nanoseconds of the GPU's global timer (int64); 0 under the interpreter."""
    if INTERPRET:
        return tl.zeros([1], tl.int64)
    else:
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;",
            "=l,r",
            [tl.zeros([1], tl.int32)],
            dtype=tl.int64,
            is_pure=False,
            pack=1,
        )


@triton.jit
def load_epoch(buffer_ptr):
    """The epoch of this launch: one past the last completed one (uint32). buffer_ptr: *int32 local."""
    return tl.load(buffer_ptr + CTRL_EPOCH).to(tl.uint32, bitcast=True) + 1


@triton.jit
def flag_slot_offset(flag_off, kind, program, source_rank, max_programs, WS: tl.constexpr):
    """Byte offset of the flag that source_rank sets for `program` of the given kind."""
    return flag_off + ((program.to(tl.int64) + kind * max_programs) * WS + source_rank) * 4


@triton.jit
def _release_flags(base, rank, epoch, kind, flag_off, max_programs, WS: tl.constexpr, WS_P2: tl.constexpr,
                   INTERPRET: tl.constexpr):  # fmt: skip
    """Release-store epoch into this rank's flag slot (of this program and kind) in the buffers at the
    WS_P2 int64 base addresses `base`, after a barrier over this program's data stores."""
    slot = flag_slot_offset(flag_off, kind, tl.program_id(0), rank, max_programs, WS)
    # every thread's data stores must precede the release store (bar.sync, then release is cumulative)
    tl.debug_barrier()
    store_release_sys(base + slot, tl.zeros([WS_P2], tl.uint32) + epoch, INTERPRET)


@triton.jit
def _spin_until_arrived(addresses, lanes, ignored, epoch, timeout, buffer_ptr, INTERPRET: tl.constexpr):
    """The bounded spin: acquire-load the local flags at `addresses` (one per lane) until every lane not
    `ignored` reached epoch or `timeout` passed (ns; iterations under the interpreter); on timeout OR the
    missing lanes' bits into the error word and carry on."""
    flags = load_acquire_sys(addresses, INTERPRET)
    arrived = ((flags - epoch) < ARRIVED_WINDOW) | ignored
    all_arrived = tl.min(arrived.to(tl.int32), 0)
    start = clock_ns(INTERPRET)
    waited = start - start
    while (all_arrived == 0) & (tl.max(waited, 0) < timeout):
        flags = load_acquire_sys(addresses, INTERPRET)
        arrived = ((flags - epoch) < ARRIVED_WINDOW) | ignored
        all_arrived = tl.min(arrived.to(tl.int32), 0)
        if INTERPRET:
            waited = waited + 1
        else:
            waited = clock_ns(INTERPRET) - start
    if all_arrived == 0:
        missing = tl.sum(tl.where(arrived, 0, 1 << lanes), 0)
        tl.atomic_or(buffer_ptr + CTRL_ERROR, missing)
    # the acquire above was done by some threads; the barrier extends it to the whole program
    tl.debug_barrier()


@triton.jit
def signal_peers(peer_table, rank, epoch, kind, flag_off, max_programs, WS: tl.constexpr, WS_P2: tl.constexpr,
                 INTERPRET: tl.constexpr):  # fmt: skip
    """After this program's pushes: store epoch into this rank's flag slot in every rank's buffer."""
    lanes = tl.arange(0, WS_P2)
    peer = tl.where(lanes < WS, lanes, rank)  # spare lanes repeat this rank's own (harmless) store
    base = tl.load(peer_table + peer)
    _release_flags(base, rank, epoch, kind, flag_off, max_programs, WS, WS_P2, INTERPRET)


@triton.jit
def wait_for_peers(peer_table, buffer_ptr, rank, epoch, kind, flag_off, max_programs, timeout,
                   WS: tl.constexpr, WS_P2: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """Spin on this rank's own flags of this program until every rank's flag reached epoch.

    Bounded: after `timeout` (ns; iterations under the interpreter) the missing ranks' bits are OR-ed
    into the error word and the program carries on with whatever is in the buffer.
    """
    lanes = tl.arange(0, WS_P2)
    valid = lanes < WS
    own_base = tl.load(peer_table + rank)
    addresses = own_base + flag_slot_offset(flag_off, kind, tl.program_id(0), tl.where(valid, lanes, 0),
                                            max_programs, WS)  # fmt: skip
    _spin_until_arrived(addresses, lanes, lanes >= WS, epoch, timeout, buffer_ptr, INTERPRET)


@triton.jit
def signal_ranks(peer_table, rank, epoch, kind, flag_off, max_programs, targets, WS: tl.constexpr,
                 WS_P2: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """signal_peers for the ranks in the bitmask `targets` (a runtime int) only. Lanes of other ranks
    repeat this rank's store into its own buffer, which no schedule that signals selectively waits on."""
    lanes = tl.arange(0, WS_P2)
    chosen = (lanes < WS) & (((targets >> lanes) & 1) == 1)
    base = tl.load(peer_table + tl.where(chosen, lanes, rank))
    _release_flags(base, rank, epoch, kind, flag_off, max_programs, WS, WS_P2, INTERPRET)


@triton.jit
def wait_for_sources(peer_table, buffer_ptr, rank, epoch, kind, flag_off, max_programs, timeout, sources,
                     WS: tl.constexpr, WS_P2: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """wait_for_peers for the ranks in the bitmask `sources` (a runtime int) only; bounded the same way,
    and only those ranks can be named in the error word."""
    lanes = tl.arange(0, WS_P2)
    ignored = (lanes >= WS) | (((sources >> lanes) & 1) == 0)
    own_base = tl.load(peer_table + rank)
    addresses = own_base + flag_slot_offset(flag_off, kind, tl.program_id(0), tl.where(ignored, 0, lanes),
                                            max_programs, WS)  # fmt: skip
    _spin_until_arrived(addresses, lanes, ignored, epoch, timeout, buffer_ptr, INTERPRET)


@triton.jit
def finish_launch(buffer_ptr, epoch):
    """Count this program out; the last program of the launch publishes epoch for the next launch."""
    tl.debug_barrier()
    finished = tl.atomic_add(buffer_ptr + CTRL_DONE, 1, sem="acq_rel", scope="gpu")
    if finished == tl.num_programs(0) - 1:
        tl.store(buffer_ptr + CTRL_DONE, 0)
        tl.store(buffer_ptr + CTRL_EPOCH, epoch.to(tl.int32, bitcast=True))
