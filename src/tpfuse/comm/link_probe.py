"""The start-up link probe: peer write / read bandwidth and latency through the workspace's mapped
buffers, per ordered pair and one-to-many, plus writes into pinned host memory for comparison.

Runs after the gate and before any all-reduce or graph capture (it overwrites the data regions and the
probe words). Collective: one rank measures at a time while the others wait at a barrier, so a pair's
figure is not shared with other traffic; the fan-out figures are one rank writing (or reading) all its
peers at once. link_decision.decide_candidates turns the numbers into the candidate set.

- bandwidth: a Triton copy of `nbytes` in 16-byte vectors between this rank's buffer and the peer's
  (write: local -> peer, read: peer -> local), timed by CUDA events over several launches;
- latency: one program doing `iters` release stores (write) or dependent acquire loads (read) of a
  peer's word at system scope, timed by the GPU's global timer inside the kernel: the cost of one
  flag signal / one round trip of the protocol, not of a bulk transfer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.comm.link_decision import LinkMeasurements
from tpfuse.comm.sync import clock_ns, load_acquire_sys, store_release_sys
from tpfuse.comm.workspace import RankWorkspace

COPY_BLOCK = 2048  # int32 words per program per step (8 KiB)
COPY_PROGRAMS = 64
COPY_BYTES_PER_LAUNCH = 32 << 20  # passes over the transfer per launch: launch overhead stays < ~5 %
LATENCY_ITERS = 1000
DEFAULT_BYTES = 8 << 20


@triton.jit
def _copy_kernel(src_table, dst_table, nwords, passes, BLOCK: tl.constexpr):
    """grid (programs, targets): programs of axis 1 = t copy nwords int32 words from the address
    src_table[t] to dst_table[t], `passes` times, each program a strided share; all targets at once
    (fan-out). Volatile loads: every pass reads the source again."""
    target = tl.program_id(1)
    src = tl.load(src_table + target).to(tl.pointer_type(tl.int32))
    dst = tl.load(dst_table + target).to(tl.pointer_type(tl.int32))
    offs = tl.arange(0, BLOCK)
    for _ in range(passes):
        for start in range(tl.program_id(0) * BLOCK, nwords, tl.num_programs(0) * BLOCK):
            m = start + offs < nwords
            tl.store(dst + start + offs, tl.load(src + start + offs, mask=m, volatile=True), mask=m)


@triton.jit
def _latency_kernel(address, out_ptr, iters, WRITE: tl.constexpr):
    """iters release stores to (WRITE) or dependent acquire loads from the word at `address`; writes
    the elapsed nanoseconds to out_ptr[0]."""
    addresses = tl.zeros([1], tl.int64) + address
    value = tl.zeros([1], tl.uint32)
    start = clock_ns(False)
    for k in range(iters):
        if WRITE:
            store_release_sys(addresses, value + k, False)
        else:
            value = load_acquire_sys(addresses + (value >> 31).to(tl.int64), False)
    elapsed = clock_ns(False) - start
    tl.store(out_ptr + tl.arange(0, 1), elapsed + (value & 0).to(tl.int64))


def _table(addresses: list[int], device) -> torch.Tensor:
    return torch.tensor(addresses, dtype=torch.int64, device=device)


def copy_passes(nbytes: int, num_targets: int) -> int:
    """Passes over an nbytes transfer per launch so that one launch moves about COPY_BYTES_PER_LAUNCH
    in all: a 1 MB copy over a fast link takes microseconds, no longer than the launch itself."""
    return max(1, COPY_BYTES_PER_LAUNCH // max(nbytes * num_targets, 1))


def copy_gbps(sources: list[int], targets: list[int], nbytes: int, device, launches: int = 5) -> float:
    """Aggregate GB/s of copying nbytes from each sources[t] to targets[t] concurrently (one launch,
    copy_passes times over the data)."""
    src, dst = _table(sources, device), _table(targets, device)
    nwords = nbytes // 4
    passes = copy_passes(nbytes, len(targets))
    grid = (COPY_PROGRAMS, len(targets))
    _copy_kernel[grid](src, dst, nwords, passes, BLOCK=COPY_BLOCK)  # compiles the timed specialisation
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        _copy_kernel[grid](src, dst, nwords, passes, BLOCK=COPY_BLOCK)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    return nwords * 4 * len(targets) * passes * launches / seconds / 1e9


def latency_us(address: int, device, write: bool, iters: int = LATENCY_ITERS) -> float:
    out = torch.zeros(1, dtype=torch.int64, device=device)
    _latency_kernel[(1,)](address, out, 16, WRITE=write, num_warps=1)
    _latency_kernel[(1,)](address, out, iters, WRITE=write, num_warps=1)
    return int(out.item()) / iters / 1e3


def _data(ws: RankWorkspace, peer: int, nbytes: int) -> int:
    """Address (as seen here) of the probe's transfer area in peer's buffer: this rank's first slot."""
    return int(ws.peer_table[peer].item()) + ws.layout.data_off + ws.rank * ws.layout.slot_bytes


def transfer_bytes(ws: RankWorkspace, nbytes: int = DEFAULT_BYTES) -> int:
    return max(4096, min(nbytes, ws.layout.slot_bytes) // 4096 * 4096)


def measure_pair(ws: RankWorkspace, peer: int, nbytes: int) -> tuple[float, float, float, float]:
    """(write GB/s, read GB/s, write latency us, read latency us) from this rank to `peer`."""
    own, theirs = _data(ws, ws.rank, nbytes), _data(ws, peer, nbytes)
    word = int(ws.peer_table[peer].item()) + ws.layout.probe_off + 4 * ws.rank
    return (
        copy_gbps([own], [theirs], nbytes, ws.device),
        copy_gbps([theirs], [own], nbytes, ws.device),
        latency_us(word, ws.device, write=True),
        latency_us(word, ws.device, write=False),
    )


def measure_fanout(ws: RankWorkspace, peers: list[int], nbytes: int, write: bool) -> float | None:
    """Aggregate GB/s of this rank writing to (or reading from) every rank of `peers` at once."""
    if not peers:
        return None
    own = _data(ws, ws.rank, nbytes)
    remote = [_data(ws, p, nbytes) for p in peers]
    scratch = torch.empty(len(peers) * nbytes, dtype=torch.uint8, device=ws.device)
    locals_ = [scratch.data_ptr() + i * nbytes for i in range(len(peers))]  # reads land apart
    if write:
        return copy_gbps([own] * len(peers), remote, nbytes, ws.device)
    return copy_gbps(remote, locals_, nbytes, ws.device)


def measure_host(ws: RankWorkspace, nbytes: int) -> tuple[float, float]:
    """(GB/s, latency us) of this rank writing into pinned host memory through its device mapping."""
    host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    gbps = copy_gbps([_data(ws, ws.rank, nbytes)], [host.data_ptr()], nbytes, ws.device)
    return gbps, latency_us(host.data_ptr(), ws.device, write=True)


def _measurements(world: int, rows: list[dict], nbytes: int) -> LinkMeasurements:
    def matrix(key):
        return [[None if i == j else rows[i][key][j] for j in range(world)] for i in range(world)]

    return LinkMeasurements(
        world, matrix("write"), matrix("read"), matrix("write_lat"), matrix("read_lat"),
        [r["fanout_write"] for r in rows], [r["fanout_read"] for r in rows],
        [r["island_write"] for r in rows], [r["host_gbps"] for r in rows], [r["host_lat"] for r in rows],
        nbytes,
    )  # fmt: skip


def _own_row(ws: RankWorkspace, nbytes: int, barrier, my_turn) -> dict:
    world, rank = ws.world_size, ws.rank
    row = {k: [None] * world for k in ("write", "read", "write_lat", "read_lat")}
    peers = [p for p in range(world) if p != rank]
    island = next((i for i in ws.islands or () if rank in i), ())
    island_peers = [p for p in island if p != rank]
    for writer in range(world):
        for peer in range(world):
            if writer == peer:
                continue
            barrier()
            if my_turn(writer):
                w, r, wl, rl = measure_pair(ws, peer, nbytes)
                row["write"][peer], row["read"][peer], row["write_lat"][peer], row["read_lat"][peer] = (
                    w,
                    r,
                    wl,
                    rl,
                )
    for writer in range(world):
        barrier()
        if my_turn(writer):
            row["fanout_write"] = measure_fanout(ws, peers, nbytes, write=True)
            row["fanout_read"] = measure_fanout(ws, peers, nbytes, write=False)
            row["island_write"] = (
                measure_fanout(ws, island_peers, nbytes, write=True) if len(island_peers) > 1 else None
            )
            row["host_gbps"], row["host_lat"] = measure_host(ws, nbytes)
    barrier()
    return row


def probe_links(ws: RankWorkspace, group, nbytes: int = DEFAULT_BYTES) -> LinkMeasurements:
    """Collective over group: every rank's links measured in turn; the same result on every rank."""
    import torch.distributed as dist

    nbytes = transfer_bytes(ws, nbytes)

    def barrier():
        torch.cuda.synchronize(ws.device)
        dist.barrier(group=group)

    row = _own_row(ws, nbytes, barrier, lambda writer: writer == ws.rank)
    rows: list = [None] * ws.world_size
    dist.all_gather_object(rows, row, group=group)
    return _measurements(ws.world_size, rows, nbytes)


def probe_virtual(workspaces: list[RankWorkspace], nbytes: int = 1 << 20) -> LinkMeasurements:
    """The same measurements for virtual ranks of one process (one GPU: not link figures)."""
    nbytes = transfer_bytes(workspaces[0], nbytes)
    device = workspaces[0].device
    rows = [_own_row(ws, nbytes, lambda: torch.cuda.synchronize(device), lambda w, r=ws.rank: w == r)
            for ws in workspaces]  # fmt: skip
    m = _measurements(len(workspaces), rows, nbytes)
    m.notes.append("virtual ranks on one GPU: these are not link figures")
    return m
