"""`tpfuse doctor`: what the GPUs, links and software can run, and which all-reduce paths tpfuse uses.

Everything is asked of the machine: device properties, NVML for the driver and the link of each pair,
CUDA for peer access, and a kernel self-test (two virtual ranks on GPU 0: the peer write/readback test
and one fused all-reduce against a reference). With no GPU it says so and reports the CPU path.
"""

from __future__ import annotations

import platform


def _versions() -> dict:
    import torch
    import triton

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda_runtime": torch.version.cuda,
    }


def _driver() -> tuple[str | None, str | None]:
    """(driver version, None) from NVML, or (None, why not)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return (version.decode() if isinstance(version, bytes) else version), None
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - NVML missing or unusable: say so, keep going
        return None, f"NVML unavailable ({type(exc).__name__}: {exc}); install nvidia-ml-py for link types"


def _gpus() -> list[dict]:
    import torch

    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append(
            {
                "index": i,
                "name": p.name,
                "compute_capability": f"{p.major}.{p.minor}",
                "memory_gib": round(p.total_memory / 2**30, 1),
                "multiprocessors": p.multi_processor_count,
            }
        )
    return gpus


def kernel_self_test(device: str = "cuda:0", world_size: int = 2) -> str | None:
    """Runs tpfuse's kernels as virtual ranks on one GPU; returns None when they work, else why not."""
    import torch

    from tpfuse.comm import launch
    from tpfuse.comm.topology import peer_write_test_virtual
    from tpfuse.comm.workspace import create_virtual_workspaces

    try:
        wss = create_virtual_workspaces(world_size, device, 4 * 1024 * 2, 4, timeout_s=5.0)
        problems = peer_write_test_virtual(wss)
        if problems:
            return "; ".join(problems)
        g = torch.Generator(device="cpu").manual_seed(0)
        xs = [torch.randn(4, 1024, generator=g).bfloat16().to(device) for _ in range(world_size)]
        residual = torch.randn(4, 1024, generator=g).bfloat16().to(device)
        weight = torch.ones(1024, dtype=torch.bfloat16, device=device)
        streams = [torch.cuda.Stream(device) for _ in range(world_size)]
        outs = []
        for r in range(world_size):
            streams[r].wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(streams[r]):
                outs.append(launch.fused_add_rmsnorm(wss[r], xs[r], residual, weight, 1e-6, "one_shot"))
        torch.cuda.synchronize(device)
        for ws in wss:
            ws.check()
        expected = (sum(x.float() for x in xs) + residual.float()).bfloat16()
        if not all(torch.equal(new_residual, expected) for _, new_residual in outs):
            return "fused all-reduce self-test gave a wrong sum"
        return None
    except Exception as exc:  # noqa: BLE001 - the reason is the report
        return f"{type(exc).__name__}: {exc}"


def _paths(gpus: list[dict], peer: list[list[bool]], self_test_error: str | None) -> list[dict]:
    import importlib.util

    n = len(gpus)
    symm = importlib.util.find_spec("torch.distributed._symmetric_memory") is not None
    kernels_ok = self_test_error is None
    paths = []
    if n == 0:
        return [
            {
                "path": "gloo (CPU)",
                "used": True,
                "why": "no CUDA GPU: tensor parallelism runs on CPU over gloo",
            },
            {"path": "tpfuse custom kernels", "used": False, "why": "no CUDA GPU"},
            {"path": "NCCL", "used": False, "why": "no CUDA GPU"},
        ]
    custom_why = (
        "kernel self-test passed; each TP group re-checks with a write/readback test across its ranks "
        "(all vote) and, with --allreduce auto, uses them only for sizes where they beat NCCL"
        if kernels_ok
        else f"kernel self-test failed: {self_test_error}"
    )
    if n > 1:
        blocked = [(i, j) for i in range(n) for j in range(n) if i != j and not peer[i][j]]
        if blocked and kernels_ok:
            custom_why = f"no peer access between GPU pairs {blocked}: groups spanning them use NCCL"
    paths.append(
        {"path": "tpfuse one-shot / two-shot / fused (custom kernels)", "used": kernels_ok, "why": custom_why}
    )
    paths.append(
        {
            "path": "workspace: torch symmetric memory",
            "used": symm and kernels_ok,
            "why": "tried first for peer buffers; CUDA IPC when it fails"
            if symm
            else "not in this torch build",
        }
    )
    paths.append({"path": "workspace: CUDA IPC", "used": kernels_ok, "why": "fallback for peer buffers"})
    paths.append(
        {
            "path": "NCCL",
            "used": n > 1,
            "why": (
                "fallback and competitor per size bucket; cannot serve ranks that share one GPU"
                if n > 1
                else "one GPU: ranks sharing it (--devices 0,0) cannot use NCCL; gloo through CPU copies is "
                "their fallback and tpfuse's kernels carry every message that fits"
            ),
        }
    )
    return paths


def _topology_and_islands(report: dict) -> None:
    """report["topology"] (NUMA node, bus id per GPU, NVML levels, NVLink) and report["islands"]."""
    from tpfuse.comm.host_topology import derive_islands, read_host_topology

    try:
        topology = read_host_topology()
    except RuntimeError as exc:
        report["topology"] = {"error": str(exc)}
        return
    report["topology"] = topology.to_json()
    islands, reason = derive_islands(topology)
    report["islands"] = {"islands": [list(i) for i in islands], "reason": reason}


def _plan(report: dict, tp_size: int, hidden: int, max_tokens: int, islands: str | None) -> None:
    """report["plan"]: what create_communicator builds for tp_size ranks here (doctor_plan.py)."""
    import torch

    if not torch.cuda.is_available():
        report["plan"] = {"error": "no CUDA GPU: --tp-size N runs on CPU over gloo, no plan to show"}
        return
    if tp_size < 2:
        report["plan"] = {"error": "--tp-size 1 has no all-reduce"}
        return
    from tpfuse.comm.doctor_plan import plan_report

    try:
        report["plan"] = {"tp_size": tp_size, "hidden": hidden, "max_tokens": max_tokens,
                          **plan_report(tp_size, hidden, max_tokens, islands=islands)}  # fmt: skip
    except RuntimeError as exc:
        report["plan"] = {"error": str(exc)}


def doctor_report(self_test: bool = True, tp_size: int | None = None, hidden: int = 4096,
                  max_tokens: int = 256, islands: str | None = None) -> dict:  # fmt: skip
    """The whole report as a JSON-able dict. With tp_size, also the plan those ranks would use."""
    import torch

    report = {"versions": _versions(), "gpus": [], "driver": None}
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        report["message"] = "no CUDA GPU visible: tensor parallelism runs on CPU over gloo"
        report["paths"] = _paths([], [], None)
        if tp_size is not None:
            _plan(report, tp_size, hidden, max_tokens, islands)
        return report
    from tpfuse.comm.topology import link_types, peer_access_matrix

    gpus = _gpus()
    report["gpus"] = gpus
    report["driver"], nvml_error = _driver()
    peer = peer_access_matrix(len(gpus))
    report["peer_access"] = peer
    links = {}
    if nvml_error is None and len(gpus) > 1:
        try:
            links = link_types(len(gpus))
        except Exception as exc:  # noqa: BLE001
            nvml_error = f"NVML link query failed: {type(exc).__name__}: {exc}"
    report["links"] = [{"gpus": list(pair), "link": link} for pair, link in sorted(links.items())]
    if nvml_error:
        report["nvml"] = nvml_error
    error = kernel_self_test() if self_test else "not run"
    report["kernel_self_test"] = "ok" if error is None else error
    report["paths"] = _paths(gpus, peer, error)
    _topology_and_islands(report)
    if tp_size is not None:
        _plan(report, tp_size, hidden, max_tokens, islands)
    return report


def format_report(report: dict) -> str:
    """Human-readable doctor output."""
    v = report["versions"]
    lines = [
        f"torch {v['torch']}  triton {v['triton']}  CUDA runtime {v['cuda_runtime']}  python {v['python']}"
    ]
    if not report["gpus"]:
        lines.append(report["message"])
    else:
        lines.append(f"driver {report['driver'] or 'unknown'}")
        for g in report["gpus"]:
            lines.append(
                f"GPU {g['index']}: {g['name']}  cc {g['compute_capability']}  {g['memory_gib']} GiB  "
                f"{g['multiprocessors']} SMs"
            )
        if len(report["gpus"]) > 1:
            lines.append("peer access (row -> column):")
            lines += ["  " + " ".join("Y" if ok else "." for ok in row) for row in report["peer_access"]]
        lines += [
            f"GPU {a} <-> GPU {b}: {link['link']}" for link in report["links"] for a, b in [link["gpus"]]
        ]
        if "nvml" in report:
            lines.append(report["nvml"])
        lines.append(f"kernel self-test (2 virtual ranks on GPU 0): {report['kernel_self_test']}")
    lines.append("all-reduce paths:")
    for p in report["paths"]:
        lines.append(f"  [{'x' if p['used'] else ' '}] {p['path']}: {p['why']}")
    lines += _format_topology(report)
    if "plan" in report:
        lines += _format_plan(report["plan"])
    return "\n".join(lines)


def _format_topology(report: dict) -> list[str]:
    topology = report.get("topology")
    if topology is None:
        return []
    if "error" in topology:
        return [f"topology: {topology['error']}"]
    lines = ["topology:"]
    for g in topology["gpus"]:
        node = "unknown" if g["numa_node"] is None else g["numa_node"]
        lines.append(f"  GPU {g['index']}: bus {g['bus_id']}  NUMA node {node}")
    if "islands" in report:
        islands = ";".join(",".join(map(str, i)) for i in report["islands"]["islands"])
        lines.append(f"islands (one rank per GPU): {islands}  ({report['islands']['reason']})")
    return lines


def _probe_summary(links: dict) -> str:
    """One line of the link probe's medians (GB/s, us) over the ordered pairs."""
    import statistics

    def median(key):
        values = [v for row in links[key] for v in row if v is not None]
        return statistics.median(values) if values else float("nan")

    fan_w, fan_r = statistics.median(links["fanout_write_gbps"]), statistics.median(links["fanout_read_gbps"])
    return (
        f"link probe medians: peer write {median('write_gbps'):.1f} GB/s, read {median('read_gbps'):.1f} "
        f"GB/s, write latency {median('write_latency_us'):.2f} us, read latency "
        f"{median('read_latency_us'):.2f} us; fan-out write {fan_w:.1f} GB/s, read {fan_r:.1f} GB/s"
    )


def _format_plan(plan: dict) -> list[str]:
    if "error" in plan:
        return [f"plan: {plan['error']}"]
    lines = [f"plan for --tp-size {plan['tp_size']} (hidden {plan['hidden']}, up to {plan['max_tokens']} "
             f"tokens): {plan['communicator']}"]  # fmt: skip
    links = plan.get("probe")
    if links:
        lines.append("  " + _probe_summary(links))
    probe = plan.get("probe_decision")
    if probe:
        lines += [f"  link probe: {f}" for f in probe["findings"]]
    lines += [f"  not a candidate: {name}: {why}" for name, why in plan.get("removed", {}).items()]
    lines += ["  " + line for line in plan["describe"].splitlines()]
    return lines
