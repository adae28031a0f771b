"""`tpfuse doctor --tp-size N`: the plan create_communicator would build for N ranks on this machine,
found by building it: N spawned ranks (one per GPU with NCCL, or sharing GPUs over gloo as the engine
does) run the gate, the islands, the link probe and the start-up race, and rank 0 reports them.
"""

from __future__ import annotations

import os
import traceback


def _rank(rank: int, world_size: int, port: int, cfg: dict, queue) -> None:
    import torch
    import torch.distributed as dist

    try:
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", rank * gpus // world_size)
        torch.cuda.set_device(device)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if world_size > gpus:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        else:
            dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
        from tpfuse.comm.factory import create_communicator

        comm = create_communicator(
            device=device, max_tokens=cfg["max_tokens"], hidden_size=cfg["hidden"],
            dtype=getattr(torch, cfg["dtype"]), islands=cfg["islands"],
        )  # fmt: skip
        result = {"communicator": type(comm).__name__, "describe": comm.describe()}
        plan = getattr(comm, "plan", None)
        result["plan"] = plan.to_json() if plan is not None else None
        ws = getattr(comm, "workspace", None)
        result["islands"] = [list(i) for i in ws.islands] if ws is not None and ws.islands else None
        result["candidates"] = list(getattr(comm, "candidates", ()))
        result["removed"] = dict(getattr(comm, "removed", {}))
        links, decision = getattr(comm, "links", None), getattr(comm, "probe_decision", None)
        result["probe"] = links.to_json() if links is not None else None
        result["probe_decision"] = decision.to_json() if decision is not None else None
        dist.barrier()
        if rank == 0:
            queue.put(("ok", result))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def plan_report(tp_size: int, hidden: int, max_tokens: int, dtype: str = "bfloat16",
                islands: str | None = None, timeout_s: float = 600.0) -> dict:  # fmt: skip
    """Rank 0's view of the communicator N ranks build here: plan buckets with timings and reasons,
    islands, candidates and the schedules removed (with why), probe measurements and findings.
    Raises RuntimeError with the failing rank's traceback."""
    from tpfuse.comm.spawn_ranks import run_spawned_ranks

    cfg = {"hidden": hidden, "max_tokens": max_tokens, "dtype": dtype, "islands": islands}
    status, payload = run_spawned_ranks(_rank, tp_size, cfg, timeout_s)
    if status != "ok":
        raise RuntimeError(f"doctor --tp-size {tp_size}: {payload}")
    return payload
