"""The short table at the end of a GPU suite run: one line per result found in a results folder, its
key figures and, where an issue sets a target, whether this run met it.

Reads what the suite's scripts write into $OUT: gpu_tests.xml (pytest --junitxml), decode.json,
bf16_parity.json, kernels.json, gemv.json, comm_*.json, tp_decode.json, spec_decode.json,
mixed_steps.json and serve_bench/. A result that is missing is left out; one that cannot be read says why.

    python benchmarks/suite_summary.py [DIR]        # DIR: the results folder, $OUT by default
"""

from __future__ import annotations

import csv
import glob
import json
import os
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable

Row = tuple[str, str, str]  # (result, figures, target and verdict; "" where no target applies)


def load_json(*parts: str):
    with open(os.path.join(*parts)) as f:
        return json.load(f)


def verdict(met: bool, target: str) -> str:
    return f"{'met' if met else 'NOT MET'} ({target})"


def gpu_tests(folder: str) -> list[Row]:
    suite = ET.parse(os.path.join(folder, "gpu_tests.xml")).getroot()
    suites = [suite] if suite.tag == "testsuite" else list(suite.iter("testsuite"))
    total = {
        key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")
    }
    failed = total["failures"] + total["errors"]
    passed = total["tests"] - failed - total["skipped"]
    figures = f"{passed} passed, {failed} failed, {total['skipped']} skipped"
    return [("GPU tests", figures, verdict(failed == 0 and passed > 0, "all pass"))]


def decode(folder: str) -> list[Row]:
    result = load_json(folder, "decode.json")
    fraction = result["batch1_fraction_of_roofline"]
    rows = [
        (
            f"decode {result['model']} batch 1",
            f"{result['batch1_tok_s_median']:.1f} tok/s = {fraction:.1%} of {result['roofline_tok_s']:.1f} "
            "tok/s roofline",
            verdict(fraction >= 0.85, ">= 85 % of roofline"),
        )
    ]
    steps = result.get("step_ms", {})
    if "1" in steps and "64" in steps:
        ratio = steps["64"] / steps["1"]
        figures = f"{steps['64']:.3f} ms / {steps['1']:.3f} ms = {ratio:.2f}x"
        rows.append(("decode step batch 64 / batch 1", figures, verdict(ratio <= 1.25, "<= 1.25x")))
    if result.get("transformers_tok_s"):
        rows.append(("transformers eager generate", f"{result['transformers_tok_s']:.1f} tok/s", ""))
    return rows


def bf16_parity(folder: str) -> list[Row]:
    archs = load_json(folder, "bf16_parity.json")
    figures = ", ".join(f"{a['architecture']} {a['match_rate']:.3f}" for a in archs)
    early = [m for a in archs for m in a["early_mismatches"]]
    bugs = [m for m in early if not m["near_tie"]]
    target = f"every early mismatch a near-tie ({len(early)} early mismatches)"
    return [("bf16 greedy match rate vs transformers", figures, verdict(not bugs, target))]


def kernels(folder: str) -> list[Row]:
    rows = load_json(folder, "kernels.json")["rows"]
    small = [r for r in rows if r.get("op") == "SMALL OPS PER DECODE STEP after"]
    return [(f"small ops of one decode step, {r['shape']}", f"{r['us']:.0f} us", "") for r in small]


def gemv(folder: str) -> list[Row]:
    steps = load_json(folder, "gemv.json")["steps"]
    return [
        (
            f"projections per step, M = {s['M']}",
            f"cuBLAS {s['cublas_step_us']:.0f} us, faster of cuBLAS / Triton GEMV {s['best_step_us']:.0f} us",
            "",
        )
        for s in steps
    ]


def comm(folder: str) -> list[Row]:
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "comm_*.json"))):
        result = load_json(path)
        env = result["environment"]
        fused = [
            min(v for v in (r.get("tpfuse_fused_one_shot"), r.get("tpfuse_fused_two_shot")) if v is not None)
            for r in result["rows"]
            if r.get("tpfuse_fused_one_shot") is not None or r.get("tpfuse_fused_two_shot") is not None
        ]
        name = os.path.basename(path)[len("comm_") : -len(".json")]
        label = f"fused all-reduce + norm, {name} ({env['layout']})"
        if env.get("warning"):
            label += ": " + env["warning"]
        figures = (
            f"{min(fused):.1f}-{max(fused):.1f} us over {len(fused)} shapes" if fused else "no fused rows"
        )
        rows.append((label, figures, ""))
    return rows


def tp_decode(folder: str) -> list[Row]:
    rows = load_json(folder, "tp_decode.json")["rows"]
    return [
        (
            f"TP decode {r['model']} tp={r['tp_size']} {r['allreduce']}"
            + (" (ranks share GPUs)" if r.get("ranks_share_gpus") else ""),
            f"{r['batch1_tok_s']:.1f} tok/s = {r['fraction_of_roofline']:.1%} of roofline",
            "",
        )
        for r in rows
    ]


def spec_decode(folder: str) -> list[Row]:
    result = load_json(folder, "spec_decode.json")
    targets, rows = result["targets"], []
    if "c1_L3_fixed_over_off" in targets:
        ratio = targets["c1_L3_fixed_over_off"]
        rows.append(("EAGLE-3 C=1, L=3, fixed k vs off", f"{ratio:.2f}x", verdict(ratio >= 2.0, ">= 2.0x")))
    for key, ratio in targets.items():
        if key.startswith("adaptive_vs_best_min_ratio"):
            length = key.split()[-1]
            rows.append(
                (
                    f"adaptive vs best of off / fixed, {length}",
                    f"worst {ratio:.3f}",
                    verdict(ratio >= 0.97, ">= 0.97"),
                )
            )
    crossover = ", ".join(
        f"L={L}: " + (f"C={c}" if c is not None else "beyond the largest C")
        for L, c in result["crossover_fixed"].items()
    )
    rows.append(("crossover where fixed k stops paying", crossover, ""))
    return rows


def mixed_steps(folder: str) -> list[Row]:
    """benchmarks/mixed_steps.py: each case's step with and without the piecewise graphs; the graphs
    must never be slower than eager (start-up drops the buckets where they would be)."""
    result = load_json(folder, "mixed_steps.json")
    rows = []
    for case in result["cases"]:
        on, off = case.get("on"), case["off"]
        label = f"mixed step {case['batch']} decodes + {case['prompt']} prompt tokens"
        if on is None:
            rows.append((label, f"eager {off:.2f} ms (no piecewise graphs)", ""))
            continue
        figures = f"graphs {on:.2f} ms, eager {off:.2f} ms: {off / on:.2f}x"
        rows.append((label, figures, verdict(on <= 1.03 * off, "graphs within 3 % of eager or faster")))
    return rows


def serve_bench(folder: str) -> list[Row]:
    root, rows = os.path.join(folder, "serve_bench"), []
    single = os.path.join(root, "single_a", "summary.json")
    if os.path.exists(single):
        s = load_json(single)
        tok_s = s["tok_s"]
        energy = s.get("energy") or {}
        joules = f", {energy['j_per_token']:.2f} J/token" if energy.get("j_per_token") else ""
        rows.append(("server single stream", f"{tok_s['mean']:.1f} tok/s, CV {tok_s['cv']:.1%}{joules}", ""))
    sweep = os.path.join(root, "sweep_a", "sweep.csv")
    if os.path.exists(sweep):
        with open(sweep) as f:
            points = list(csv.DictReader(f))
        figures = ", ".join(f"C={p['concurrency']}: {float(p['output_tok_s_mean']):.0f}" for p in points)
        valid = all(p["valid"] == "True" for p in points)
        rows.append(("server sweep, tok/s", figures, verdict(valid, "every point valid")))
    if not rows:
        raise FileNotFoundError(f"no single_a or sweep_a results under {root}")
    return rows


SECTIONS: dict[str, tuple[str, Callable[[str], list[Row]]]] = {
    "gpu tests": ("gpu_tests.xml", gpu_tests),
    "decode": ("decode.json", decode),
    "bf16 parity": ("bf16_parity.json", bf16_parity),
    "kernels": ("kernels.json", kernels),
    "gemv": ("gemv.json", gemv),
    "comm": ("comm_*.json", comm),
    "tp decode": ("tp_decode.json", tp_decode),
    "spec decode": ("spec_decode.json", spec_decode),
    "mixed steps": ("mixed_steps.json", mixed_steps),
    "serve bench": ("serve_bench", serve_bench),
}


def summarize(folder: str) -> list[Row]:
    rows: list[Row] = []
    for name, (pattern, read) in SECTIONS.items():
        if not glob.glob(os.path.join(folder, pattern)):
            continue
        try:
            rows += read(folder)
        except (OSError, ValueError, KeyError, TypeError, ET.ParseError) as exc:
            rows.append((name, f"unreadable: {type(exc).__name__}: {exc}", ""))
    return rows


def format_rows(rows: list[Row]) -> str:
    header = ("result", "figures", "target")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(2)]
    lines = [f"{header[0]:<{widths[0]}}  {header[1]:<{widths[1]}}  {header[2]}"]
    lines.append("-" * len(lines[0]))
    lines += [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}".rstrip() for r in rows]
    return "\n".join(lines)


def main() -> int:
    folder = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", ".")
    rows = summarize(folder)
    if not rows:
        print(f"no results under {folder}", file=sys.stderr)
        return 1
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
