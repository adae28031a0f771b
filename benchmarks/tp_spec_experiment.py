"""The seeds' experiment in one command: TP decode with and without speculation, NCCL vs fused all-reduce.

For each configuration, `tpfuse serve` (dummy weights, --tp-size N) is measured with `tpfuse bench
single` (warm-ups, runs of --single-tokens) and `tpfuse bench sweep` (closed loop over
--concurrency), NVML telemetry on; then `tpfuse bench compare` pairs configurations and reports the
crossover concurrency. Configurations (pick with --configs):

    nccl          plain decoding, NCCL all-reduce
    fused         plain decoding, tpfuse's fused all-reduce + RMSNorm
    eagle3-nccl   EAGLE-3 (random head, SIMULATED acceptance length --acceptance-length), fixed k, NCCL
    eagle3-fused  the same with the fused all-reduce
    adaptive      EAGLE-3 with the adaptive policy (k = 0 included), fused all-reduce

Pairs compared: fused/nccl, eagle3-nccl/nccl, eagle3-fused/fused, adaptive/fused, adaptive/eagle3-fused.
The summary states, per concurrency, adaptive / max(fused, eagle3-fused) (target >= 0.97).

8 GPUs (the issue's run): python3 benchmarks/tp_spec_experiment.py --model llama-3.1-70b --tp-size 8
CPU smoke: python3 benchmarks/tp_spec_experiment.py --device cpu --model tiny --tp-size 2 \\
    --force-allreduce auto --configs nccl,adaptive --concurrency 1,2 --single-tokens 8 --runs 1 \\
    --warmups 1 --sweep-tokens 4 --repeats 1
Results: $OUT/tp_spec/ (one folder per single run, sweep and compare; experiment.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # last: benchmarks/kernels.py shadows no package
from serve_bench import serve_and_bench  # noqa: E402  (a sibling script)

SPEC = (
    "--speculative-algorithm eagle3 --speculative-draft-model-path {head} "
    "--speculative-simulate-acceptance-length {length}"
)
CONFIGS = {
    "nccl": "--allreduce nccl",
    "fused": "--allreduce fused",
    "eagle3-nccl": f"--allreduce nccl {SPEC} --no-speculative-adaptive",
    "eagle3-fused": f"--allreduce fused {SPEC} --no-speculative-adaptive",
    "adaptive": f"--allreduce fused {SPEC} --speculative-adaptive",
}
PAIRS = [
    ("nccl", "fused"),
    ("nccl", "eagle3-nccl"),
    ("fused", "eagle3-fused"),
    ("fused", "adaptive"),
    ("eagle3-fused", "adaptive"),
]


def server_flags(name: str, args, head: str) -> list[str]:
    flags = CONFIGS[name].format(head=head, length=args.acceptance_length)
    if args.force_allreduce:
        flags = flags.replace("--allreduce nccl", "").replace("--allreduce fused", "")
        flags += f" --allreduce {args.force_allreduce}"
    return ["--tp-size", str(args.tp_size), *shlex.split(flags), *shlex.split(args.server_args)]


def _sweep_tok_s(sweep_dir: Path) -> dict[int, float]:
    """Mean output tok/s over the repeats of each concurrency of a written sweep."""
    summary = json.loads((sweep_dir / "summary.json").read_text())
    return {p["concurrency"]: p["output_tok_s"]["mean"] for p in summary["points"]}


def _compare(a: Path, b: Path, out: Path) -> int | None:
    """Runs `tpfuse bench compare`; returns the crossover concurrency (None: B never fell below A)."""
    from tpfuse.bench.cli import register

    parser = argparse.ArgumentParser(prog="tpfuse")
    register(parser.add_subparsers())
    cmp_args = parser.parse_args(["bench", "compare", "--a", str(a), "--b", str(b), "--output-dir", str(out)])
    cmp_args.handler(cmp_args)
    return json.loads((out / "summary.json").read_text())["crossover"]["concurrency"]


def _write_head(model: str, directory: str) -> None:
    from tpfuse.config import EngineConfig
    from tpfuse.model.loader import load_model_config
    from tpfuse.spec.eagle3_checkpoint import save_random_eagle3_head

    target = load_model_config(EngineConfig(model=model, dtype="auto"))
    aux = (0, 1, 2) if target.num_layers < 8 else None
    save_random_eagle3_head(
        directory, target, draft_vocab_size=min(32000, target.vocab_size), aux_layer_ids=aux
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-70b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--tp-size", type=int, default=None, help="default: every visible GPU")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--acceptance-length", type=float, default=3.0)
    p.add_argument("--force-allreduce", default=None, help="replace every configuration's all-reduce mode")
    p.add_argument("--server-args", default="", help="extra `tpfuse serve` flags for every configuration")
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--single-tokens", type=int, default=2048, help="0 skips the single-stream runs")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sweep-tokens", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--requests-per-level", type=int, default=None, help="default: 5 x C per repeat")
    p.add_argument("--warmup-requests", type=int, default=None, help="default: C per level")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=1800.0)
    args = p.parse_args()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    if args.tp_size is None:
        import torch

        args.tp_size = max(1, torch.cuda.device_count()) if args.device == "cuda" else 2
    out = Path(os.environ.get("OUT", "/tmp/out")) / "tp_spec"
    sweeps: dict[str, Path] = {}
    with tempfile.TemporaryDirectory() as head:
        if any("eagle3" in CONFIGS[n] or "{head}" in CONFIGS[n] for n in names):
            _write_head(args.model, head)
        for name in names:
            sweeps[name] = serve_and_bench(
                args, server_flags(name, args, head), name, out, args.single_tokens > 0
            )
    crossovers = {
        f"{b}/{a}": _compare(sweeps[a], sweeps[b], out / f"compare_{b}_vs_{a}")
        for a, b in PAIRS
        if a in sweeps and b in sweeps
    }
    tok_s = {name: _sweep_tok_s(path) for name, path in sweeps.items()}
    record = {
        "model": args.model,
        "tp_size": args.tp_size,
        "simulated_acceptance_length": args.acceptance_length,
        "sweep_tok_s": tok_s,
        "crossover": crossovers,
    }
    print(
        f"\n{args.model}, TP {args.tp_size}: output tok/s by concurrency (SIMULATED acceptance for EAGLE-3)"
    )
    levels = sorted({c for points in tok_s.values() for c in points})
    print(f"{'C':>5}" + "".join(f" {n:>13}" for n in names))
    for c in levels:
        print(f"{c:>5}" + "".join(f" {tok_s[n].get(c, float('nan')):>13.1f}" for n in names))
    for pair, crossover in crossovers.items():
        print(f"{pair}: {'never below 1' if crossover is None else f'below 1 from C = {crossover}'}")
    if {"adaptive", "fused", "eagle3-fused"} <= set(names):
        ratios = {
            c: tok_s["adaptive"][c] / max(tok_s["fused"][c], tok_s["eagle3-fused"][c])
            for c in levels
            if all(c in tok_s[n] for n in ("adaptive", "fused", "eagle3-fused"))
        }
        record["adaptive_vs_best"] = ratios
        worst = min(ratios.values())
        verdict = "PASS" if worst >= 0.97 else "FAIL"
        print(f"adaptive / max(fused, eagle3-fused) >= {worst:.3f} ({verdict} target >= 0.97)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "experiment.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {out / 'experiment.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
