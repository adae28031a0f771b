"""Mapping one buffer per rank into every rank's address space: torch symmetric memory or CUDA IPC.

Each opener is collective over the group and returns (own buffer, [address of rank j's buffer as seen
by this process], objects to keep alive). Both leave the buffer zeroed on every rank before returning.
"""

from __future__ import annotations

import torch


def _barrier(group) -> None:
    import torch.distributed as dist

    torch.cuda.synchronize()
    dist.barrier(group=group)


def open_symmetric(nbytes: int, device: torch.device, group):
    """torch symmetric memory (torch.distributed._symmetric_memory): empty + rendezvous."""
    import torch.distributed._symmetric_memory as symm_mem

    with torch.cuda.device(device):
        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buffer, group.group_name)
        buffer.zero_()
        addresses = [int(p) for p in handle.buffer_ptrs]
    _barrier(group)
    return buffer, addresses, [handle]


def open_ipc(nbytes: int, device: torch.device, group):
    """CUDA IPC handles of a plain allocation, exchanged with all_gather_object over the group.

    Works for one process per GPU and for several processes sharing one GPU. Fails (and says so) when
    the allocator cannot export handles, e.g. with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
    """
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    with torch.cuda.device(device):
        buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize()
        shared = reduce_tensor(buffer)
    handles: list = [None] * world_size
    dist.all_gather_object(handles, shared, group=group)
    peers, addresses = [], []
    with torch.cuda.device(device):
        for j, (rebuild, args) in enumerate(handles):
            if j == rank:
                addresses.append(buffer.data_ptr())
                continue
            peer = rebuild(*args)
            peers.append(peer)
            addresses.append(peer.data_ptr())
    _barrier(group)
    return buffer, addresses, peers


def vote_failures(error: str | None, group) -> list[tuple[int, str]]:
    """Every rank contributes its error (None: fine); returns [(rank, error)] of all failing ranks,
    the same list on every rank."""
    import torch.distributed as dist

    world_size = dist.get_world_size(group)
    errors: list = [None] * world_size
    dist.all_gather_object(errors, error, group=group)
    return [(r, e) for r, e in enumerate(errors) if e is not None]
