"""Tensor-parallel decode through the engine: batch-1 tok/s and step time per TP size and all-reduce
mode, beside the HBM roofline and the roofline plus the measured all-reduce latency.

For each model, TP size and --allreduce mode (fused: tpfuse's kernels for every message that fits;
nccl: NCCL for everything):
  * all-reduce latency: a separate process group of the same shape times the fused all-reduce +
    residual + RMSNorm on one token ([1, hidden], the decode message), replayed in a CUDA graph.
  * engine: LLMEngine(tp_size=N), dummy weights, CUDA graphs; batch-1 decode tok/s over --tokens
    (prefill excluded; --warmups thrown away, median of --runs) and the median decode step at batch 8.
  * roofline: bytes rank 0 reads per step (its weight shard less the embedding, plus KV) x ranks on its
    GPU / measured copy bandwidth; "+ comm": that time plus 2 x layers x the all-reduce latency.
When there are fewer GPUs than ranks, ranks share GPUs round-robin (--devices 0,0,...): NCCL cannot
run there (nccl mode is skipped), and the figures are kernel latencies on one GPU, not link speed.

    python benchmarks/tp_decode.py                               # 8B (and 70B if it fits), JSON to $OUT
    python benchmarks/tp_decode.py --models llama-3.1-8b --tp-sizes 1,2 --modes fused
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # last: benchmarks/kernels.py shadows no package
from decode import PROMPT, copy_bandwidth, decode_tok_s, step_ms  # noqa: E402
from tpfuse.config import EngineConfig  # noqa: E402
from tpfuse.engine.engine import LLMEngine  # noqa: E402


def devices_for(tp_size: int) -> list[int]:
    count = torch.cuda.device_count()
    return [rank % count for rank in range(tp_size)]


def _allreduce_rank(rank, tp_size, port, devices, mode, hidden, iters, queue):
    import torch.distributed as dist

    from tpfuse.comm.factory import create_communicator

    torch.cuda.set_device(devices[rank])
    backend = "nccl" if len(set(devices)) == len(devices) else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp_size)
    try:
        comm = create_communicator(
            device=torch.device("cuda", devices[rank]),
            mode=mode,
            max_tokens=8,
            hidden_size=hidden,
            dtype=torch.bfloat16,
        )
        x = torch.randn(1, hidden, dtype=torch.bfloat16, device="cuda")
        residual = torch.randn_like(x)
        weight = torch.ones(hidden, dtype=torch.bfloat16, device="cuda")
        for _ in range(10):
            comm.fused_add_rmsnorm_all_reduce(x, residual, weight, 1e-5)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                comm.fused_add_rmsnorm_all_reduce(x, residual, weight, 1e-5)
        graph.replay()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        latency = (time.perf_counter() - start) / (5 * iters)
        if rank == 0:
            queue.put(("ok", latency, comm.describe() if hasattr(comm, "describe") else type(comm).__name__))
    except Exception as exc:
        if rank == 0:
            queue.put(("error", f"{type(exc).__name__}: {exc}", ""))
    finally:
        dist.destroy_process_group()


def allreduce_latency(tp_size: int, mode: str, hidden: int, iters: int = 50) -> tuple[float | None, str]:
    """Seconds per fused all-reduce of one bf16 token, and the communicator's description."""
    if tp_size == 1:
        return 0.0, "single rank"
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    devices = devices_for(tp_size)
    procs = [
        ctx.Process(target=_allreduce_rank, args=(r, tp_size, port, devices, mode, hidden, iters, queue))
        for r in range(tp_size)
    ]
    for p in procs:
        p.start()
    try:
        status, value, description = queue.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if status != "ok":
        return None, value
    return value, description


def rank0_step_bytes(engine: LLMEngine, context: float) -> int:
    runner = engine.executor if hasattr(engine.executor, "kv_caches") else engine.executor.runner
    model = runner.model
    total = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    if not runner.model_config.tie_word_embeddings:
        embed = model.checkpoint_slots()["model.embed_tokens.weight"].param
        total -= embed.numel() * embed.element_size()
    k, _ = runner.kv_caches[0]
    kv_per_token = k[0, 0].numel() * k.element_size() * 2 * len(runner.kv_caches)
    return int(total + kv_per_token * context)


def fits_in_memory(model: str, tp_size: int) -> bool:
    from tpfuse.model.presets import preset_config

    weights = preset_config(model, "bfloat16").num_parameters() * 2
    per_gpu = weights / tp_size * max(devices_for(tp_size).count(d) for d in set(devices_for(tp_size)))
    return per_gpu < 0.8 * torch.cuda.get_device_properties(0).total_memory


def bench_config(model, tp_size, mode, args, bandwidth) -> dict:
    from tpfuse.model.presets import preset_config

    row = {"model": model, "tp_size": tp_size, "allreduce": mode, "devices": devices_for(tp_size)}
    sharing = len(set(row["devices"])) < tp_size
    row["ranks_share_gpus"] = sharing
    if sharing and mode == "nccl":
        return {**row, "skipped": "ranks share a GPU: NCCL cannot run"}
    if not fits_in_memory(model, tp_size):
        return {**row, "skipped": "weights do not fit in GPU memory at this TP size"}
    model_config = preset_config(model, "bfloat16")
    latency, description = allreduce_latency(tp_size, mode, model_config.hidden_size)
    row["allreduce_latency_us"] = None if latency is None else latency * 1e6
    row["communicator"] = description
    config = EngineConfig(
        model=model, device="cuda", dtype="bfloat16", load_format="dummy", tp_size=tp_size,
        devices=row["devices"], allreduce=mode, max_model_len=len(PROMPT) + args.tokens + 64,
        max_running_requests=8, cuda_graph_max_bs=8,
    )  # fmt: skip
    start = time.perf_counter()
    engine = LLMEngine(config)
    row["startup_s"] = time.perf_counter() - start
    try:
        for i in range(args.warmups):
            decode_tok_s(engine, args.tokens, f"warm{i}")
        runs = [decode_tok_s(engine, args.tokens, f"run{i}") for i in range(args.runs)]
        row["batch1_tok_s_runs"] = runs
        row["batch1_tok_s"] = statistics.median(runs)
        row["batch1_step_ms"] = 1e3 / row["batch1_tok_s"]
        row["batch8_step_ms"] = step_ms(engine, 8, 4, 32)
        ranks_per_gpu = max(row["devices"].count(d) for d in set(row["devices"]))
        step_bytes = rank0_step_bytes(engine, len(PROMPT) + args.tokens / 2) * ranks_per_gpu
        roofline_s = step_bytes / bandwidth
        row["roofline_tok_s"] = 1 / roofline_s
        if latency is not None:
            row["roofline_plus_comm_tok_s"] = 1 / (roofline_s + 2 * model_config.num_layers * latency)
        row["fraction_of_roofline"] = row["batch1_tok_s"] / row["roofline_tok_s"]
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        torch.cuda.empty_cache()  # the next configuration measures free memory
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-3.1-8b,llama-3.1-70b")
    parser.add_argument(
        "--tp-sizes", default=None, help="default: 1,2,4,8 up to the GPU count (at least 1,2)"
    )
    parser.add_argument("--modes", default="fused,nccl")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--warmups", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tp_decode.json"))
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if args.tp_sizes:
        tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
    else:
        tp_sizes = [t for t in (1, 2, 4, 8) if t <= max(gpus, 2)]
    bandwidth = copy_bandwidth("cuda")
    print(f"{gpus} x {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for model in args.models.split(","):
        for tp_size in tp_sizes:
            for mode in ["fused"] if tp_size == 1 else args.modes.split(","):
                row = bench_config(model, tp_size, mode, args, bandwidth)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(
        f"\n{'model':15s} {'tp':>3s} {'mode':6s} {'share':5s} {'tok/s':>8s} {'step ms':>8s} {'bs8 ms':>8s} "
        f"{'roofline':>9s} {'+comm':>8s} {'AR us':>7s}"
    )
    for r in rows:
        if "skipped" in r:
            print(f"{r['model']:15s} {r['tp_size']:3d} {r['allreduce']:6s} skipped: {r['skipped']}")
            continue
        ar = r.get("allreduce_latency_us")
        print(
            f"{r['model']:15s} {r['tp_size']:3d} {r['allreduce']:6s} {str(r['ranks_share_gpus']):5s} "
            f"{r['batch1_tok_s']:8.1f} {r['batch1_step_ms']:8.3f} {r['batch8_step_ms']:8.3f} "
            f"{r['roofline_tok_s']:9.1f} {r.get('roofline_plus_comm_tok_s', float('nan')):8.1f} "
            f"{(ar if ar is not None else float('nan')):7.1f}"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"gpus": gpus, "copy_bandwidth_bytes_per_s": bandwidth, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
