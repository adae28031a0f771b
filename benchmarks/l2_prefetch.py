"""Does prefetching o_proj's weight into L2 (model/prefetch.py) shorten the decode step? Side by side.

Loads the model once, captures one decode-step CUDA graph (forward + logits) per setting (prefetch
off, and each budget in MiB x each number of prefetch programs), replays them round-robin so drift
affects all alike, and reports the median step time per setting, its ratio to "off", and the
roofline. Also checks that every setting's logits equal "off"'s bit for bit.

    python3 benchmarks/l2_prefetch.py --budgets-mib 8,16,32 --programs 33,66,132 --batch-sizes 1,8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_decode_roofline import copy_bandwidth, decode_inputs, step_bytes  # noqa: E402
from tpfuse.comm.communicator import SingleRankCommunicator  # noqa: E402
from tpfuse.config import EngineConfig  # noqa: E402
from tpfuse.model.layers import ParallelContext  # noqa: E402
from tpfuse.model.loader import load_model  # noqa: E402
from tpfuse.model.prefetch import L2Prefetcher  # noqa: E402


def capture(model, inputs, prefetcher: L2Prefetcher | None):
    """(graph, logits buffer) of one decode step with this prefetch setting."""
    ids, positions, attn, caches = inputs
    model.enable_l2_prefetch(prefetcher)

    def step():
        hidden, _ = model(ids, positions, attn, caches)
        return model.compute_logits(hidden)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step()
    model.enable_l2_prefetch(None)
    return graph, logits


def replay_ms(graph, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--budgets-mib", default="8,16,24,32")
    parser.add_argument("--programs", default="66,132")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "l2_prefetch.json"))
    args = parser.parse_args()

    device = torch.device("cuda")
    engine_config = EngineConfig(model=args.model, dtype="bfloat16", load_format="dummy")
    model, _ = load_model(engine_config, ParallelContext(0, 1, SingleRankCommunicator()), device)
    bandwidth = copy_bandwidth("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    print(f"{args.model} on {torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, {sms} SMs")
    settings: list[tuple[str, int, int]] = [("off", 0, 0)]
    for mib in [float(b) for b in args.budgets_mib.split(",")]:
        for programs in [int(p) for p in args.programs.split(",")]:
            settings.append((f"{mib:g} MiB x {programs} prog", int(mib * (1 << 20)), programs))
    results = []
    with torch.no_grad():
        for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
            inputs = decode_inputs(model, batch_size, args.context, 16, "cuda")
            graphs = {}
            for name, budget, programs in settings:
                prefetcher = None
                if budget:
                    prefetcher = L2Prefetcher(device, budget)
                    prefetcher.num_programs = programs
                graphs[name] = capture(model, inputs, prefetcher)
            reference = None
            times: dict[str, list[float]] = {name: [] for name, _, _ in settings}
            for _ in range(args.rounds):
                for name, (graph, logits) in graphs.items():
                    for _ in range(5):
                        graph.replay()
                    times[name].append(replay_ms(graph, args.iters))
                    if reference is None:
                        reference = logits.clone()
                    elif not torch.equal(logits, reference):
                        raise SystemExit(f"logits differ from 'off' with prefetch {name}")
            roof_ms = step_bytes(model, batch_size, args.context) / bandwidth * 1e3
            off_ms = statistics.median(times["off"])
            print(f"batch {batch_size}, context {args.context}: roofline {roof_ms:.3f} ms")
            print(f"  {'setting':<26} {'median ms':>9} {'vs off':>7} {'% roof':>7}  rounds")
            for name, samples in times.items():
                ms = statistics.median(samples)
                spread = ", ".join(f"{s:.3f}" for s in samples)
                print(f"  {name:<26} {ms:9.3f} {ms / off_ms:7.3f} {100 * roof_ms / ms:6.1f}%  {spread}")
                results.append(
                    {
                        "batch_size": batch_size,
                        "setting": name,
                        "median_ms": ms,
                        "rounds_ms": samples,
                        "roofline_ms": roof_ms,
                    }
                )
            del graphs
            torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump({"model": args.model, "context": args.context, "rows": results}, f, indent=2)
    print(f"wrote {args.json}; logits equal across settings")


if __name__ == "__main__":
    main()
