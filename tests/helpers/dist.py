"""Run a function on N ranks of a process group: gloo (CPU, for tests of tensor-parallel logic), or
NCCL with one GPU per rank (multigpu tests on the device machine)."""

from __future__ import annotations

import io
import os
import pickle
import traceback

import torch
import torch.multiprocessing as mp

from tpfuse.comm.spawn_ranks import free_port


def to_bytes(obj) -> bytes:
    """torch.save of obj as bytes: tensors returned through a multiprocessing queue are shared by file
    descriptor, which breaks once the rank process has exited; plain bytes do not."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(blobs: list[bytes]) -> list:
    """to_bytes undone for each rank's result."""
    return [torch.load(io.BytesIO(b)) for b in blobs]


def _entry(rank, world_size, port, fn, args, queue, backend):
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            dist.init_process_group(
                "nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", rank)
            )
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # plain pickle bytes: tensors in a queue are shared by file descriptor, which fails once this
        # process has exited (FileNotFoundError in the parent's get)
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0, backend: str = "gloo") -> list:
    """Runs fn(rank, world_size, *args) in world_size spawned processes and returns the results in
    rank order. backend "gloo" (CPU) or "nccl" (rank r on GPU r). fn must be a module-level function;
    its result must be picklable. A rank that raises fails the call with that rank's traceback."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, backend), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
