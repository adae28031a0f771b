"""What `tpfuse comm-bench` times and records per row, shared by its virtual-rank driver (bench.py) and
its one-process-per-rank side (bench_ranks.py)."""

from __future__ import annotations

METHODS = (
    "nccl",
    "nccl+norm",
    "symm_one_shot",
    "symm_two_shot",
    "symm_one_shot+norm",
    "tpfuse_one_shot",
    "tpfuse_two_shot",
    "tpfuse_fused_one_shot",
    "tpfuse_fused_two_shot",
    "tpfuse_fused_staged",
    "tpfuse_fused_ordered_push",
    "tpfuse_fused_pull",
)
FUSED_PREFIX = "tpfuse_fused_"
SHARED_WARNING = "ranks share one GPU: kernel latency, not a link measurement"
EPS = 1e-6


def chosen_method(timings: dict[str, float | None]) -> str | None:
    """The column the Communicator's rule picks for the fused op: the fastest tpfuse fused schedule,
    unless NCCL + norm is at least as fast (or the only one measured)."""
    from tpfuse.comm.plan import FALLBACK, decide

    measured = {k[len(FUSED_PREFIX) :]: v for k, v in timings.items() if k.startswith(FUSED_PREFIX)}
    measured[FALLBACK] = timings.get("nccl+norm")
    measured = {k: v for k, v in measured.items() if v is not None}
    if not measured:
        return None
    algorithm, _ = decide(measured)
    return "nccl+norm" if algorithm == FALLBACK else f"tpfuse_fused_{algorithm}"


def _inputs(tokens, hidden, dtype, device, rank):
    import torch

    g = torch.Generator(device="cpu").manual_seed(rank)
    x = (torch.randn(tokens, hidden, generator=g) * 0.1).to(dtype).to(device)
    residual = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(99)).to(dtype).to(device)
    return x, residual, torch.ones(hidden, dtype=dtype, device=device)


def tpfuse_calls(ws, x, residual, weight) -> dict:
    from tpfuse.comm import launch

    calls = {
        "tpfuse_one_shot": lambda: launch.all_reduce(ws, x, "one_shot"),
        "tpfuse_two_shot": lambda: launch.all_reduce(ws, x, "two_shot"),
    }
    for name in ("one_shot", "two_shot", "staged", "ordered_push", "pull"):
        calls[FUSED_PREFIX + name] = lambda a=name: launch.fused_add_rmsnorm(ws, x, residual, weight, EPS, a)
    return calls


def _row(tp, tokens, hidden, dtype) -> dict:
    import torch

    nbytes = tokens * hidden * torch.tensor([], dtype=dtype).element_size()
    return {"tp": tp, "tokens": tokens, "hidden": hidden, "bytes": nbytes, **dict.fromkeys(METHODS)}


def environment(world_size: int, layout: str, shared: bool) -> dict:
    import torch
    import triton

    p = torch.cuda.get_device_properties(0)
    env = {
        "gpu": p.name,
        "compute_capability": f"{p.major}.{p.minor}",
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "world_size": world_size,
        "layout": layout,
        "ranks_share_a_gpu": shared,
    }
    if shared:
        env["warning"] = SHARED_WARNING
    return env
