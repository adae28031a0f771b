"""The per-rank side of `tpfuse comm-bench` with one process per rank (tpfuse.comm.bench drives it).

Each rank builds every path it can (NCCL, torch symmetric memory, tpfuse's workspace), and all ranks
vote on which of them work before timing, so a path that fails on one rank is skipped everywhere
instead of hanging the others. Times are all-reduced with MAX: the slowest rank speaks.
"""

from __future__ import annotations

import os
import traceback

import torch

EPS = 1e-6


def _agreed(ok: bool, why: str | None, group) -> str | None:
    """None when every rank says ok, else the first reason given."""
    from tpfuse.comm.peer_memory import vote_failures

    failures = vote_failures(None if ok else (why or "failed"), group)
    return None if not failures else f"rank {failures[0][0]}: {failures[0][1]}"


def _symmetric_buffer(nbytes, device, group):
    import torch.distributed._symmetric_memory as symm_mem

    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(buffer, group.group_name)
    return buffer


def _symm_calls(buffer, x, residual, weight, group_name):
    from tpfuse.kernels import fused_add_rmsnorm

    view = buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
    ops = torch.ops.symm_mem

    def one_shot():
        view.copy_(x)
        return ops.one_shot_all_reduce(view, "sum", group_name)

    def two_shot():
        view.copy_(x)
        ops.two_shot_all_reduce_(view, "sum", group_name)
        return view

    return {
        "symm_one_shot": one_shot,
        "symm_two_shot": two_shot,
        "symm_one_shot+norm": lambda: fused_add_rmsnorm(one_shot(), residual, weight, EPS),
    }


def rank_main(rank: int, world_size: int, port: int, cfg: dict, queue) -> None:
    """Process entry: one rank of the benchmark. Rank 0 puts the result dict on `queue`."""
    try:
        result = _run(rank, world_size, port, cfg)
        if rank == 0:
            queue.put(("ok", result))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def _run(rank, world_size, port, cfg):
    import torch.distributed as dist

    from tpfuse.comm.bench_rows import METHODS, _inputs, _row, chosen_method, environment, tpfuse_calls
    from tpfuse.comm.communicator import TorchDistributedCommunicator
    from tpfuse.comm.topology import gate_process_workspace
    from tpfuse.comm.tuning import agree_max, time_per_call_us
    from tpfuse.comm.workspace import create_process_workspace

    gpus = torch.cuda.device_count()
    device = torch.device("cuda", rank * gpus // world_size)
    torch.cuda.set_device(device)
    shared = world_size > gpus
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if shared:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    else:
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
    group = dist.group.WORLD
    dtype = getattr(torch, cfg["dtype"])
    max_bytes = max(cfg["tokens"]) * max(cfg["hiddens"]) * torch.tensor([], dtype=dtype).element_size()
    unavailable = {}
    ws = None
    try:
        ws = create_process_workspace(group, device, max_bytes, 32 if shared else 64, timeout_s=60.0)
        failures = gate_process_workspace(ws, group)
        if failures:
            ws, why = None, f"peer test failed: {failures}"
    except RuntimeError as exc:
        why = str(exc)
    if ws is None:
        unavailable.update(dict.fromkeys(METHODS[5:], why))
    nccl = None if shared else TorchDistributedCommunicator(group)
    if nccl is None:
        unavailable.update(dict.fromkeys(METHODS[:5], "NCCL refuses ranks that share a GPU"))
    symm = None
    if nccl is not None:
        try:
            symm, why = _symmetric_buffer(max_bytes, device, group), None
        except Exception as exc:  # noqa: BLE001 - unavailable here: report why
            why = f"{type(exc).__name__}: {exc}"
        why = _agreed(symm is not None, why, group)
        if why:
            symm = None
            unavailable.update(dict.fromkeys(METHODS[2:5], why))
    rows = []
    for hidden in cfg["hiddens"]:
        for tokens in cfg["tokens"]:
            x, residual, weight = _inputs(tokens, hidden, dtype, device, rank)
            calls = {}
            if nccl is not None:
                from tpfuse.kernels import fused_add_rmsnorm

                calls["nccl"] = lambda x=x: nccl.all_reduce(x)
                calls["nccl+norm"] = lambda x=x, r=residual, w=weight: fused_add_rmsnorm(
                    nccl.all_reduce(x), r, w, EPS
                )
            if symm is not None:
                calls.update(_symm_calls(symm, x, residual, weight, group.group_name))
            if ws is not None:
                calls.update(tpfuse_calls(ws, x, residual, weight))
            row = _row(world_size, tokens, hidden, dtype)
            for name, fn in calls.items():
                try:
                    fn()
                    torch.cuda.synchronize()
                    ok, why = True, None
                except Exception as exc:  # noqa: BLE001
                    ok, why = False, f"{type(exc).__name__}: {exc}"
                why = _agreed(ok, why, group)
                if why:
                    unavailable.setdefault(name, why)
                    continue
                local = time_per_call_us(
                    fn, cfg["iters"], cfg["repeats"], barrier=lambda: dist.barrier(group=group)
                )
                row[name] = round(agree_max([local], group)[0], 2)
            if ws is not None:
                ws.check()
            row["chosen"] = chosen_method(row)
            rows.append(row)
    layout = f"{world_size} processes on {min(gpus, world_size)} GPU(s)"
    result = {"environment": environment(world_size, layout, shared), "rows": rows,
              "unavailable": unavailable, "config": cfg}  # fmt: skip
    if ws is not None:
        result["environment"]["workspace"] = ws.backend
        result["environment"]["workspace_notes"] = ws.notes
    dist.barrier(group=group)
    dist.destroy_process_group()
    return result
