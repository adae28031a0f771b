"""Terminal output: per-run lines, rich tables for single / sweep / compare, and a progress bar."""

from __future__ import annotations

import math

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def _fmt(value, scale: float = 1.0, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and (math.isnan(value) or math.isinf(value))):
        return "-"
    return f"{value * scale:.{digits}f}"


def format_run_line(run, total: int) -> str:
    """'Run 1/5: 2048 tokens in 22.13s = 92.6 tok/s' (or the error of a failed run)."""
    if not run.ok:
        return f"Run {run.index}/{total}: failed: {run.error}"
    tokens = f"{run.output_tokens:.0f} tokens"
    return f"Run {run.index}/{total}: {tokens} in {run.seconds:.2f}s = {run.tok_s:.1f} tok/s"


def format_tok_s_summary(summary) -> str:
    """'mean 92.6 tok/s, stdev 0.41, CV 0.44%, 95% CI [92.1, 93.1]'."""
    if summary is None:
        return "no successful run"
    ci = f"{summary.confidence:.0%} CI [{_fmt(summary.ci_low)}, {_fmt(summary.ci_high)}]"
    return f"mean {summary.mean:.1f} tok/s, stdev {summary.stdev:.2f}, CV {summary.cv:.2%}, {ci}"


def print_single(result, console: Console | None = None, show_notes: bool = True) -> None:
    """The runs of a SingleResult as a table, then mean / stdev / CV, energy and (optionally) notes."""
    console = console or Console()
    table = Table(title=f"single stream: {result.label}")
    for name in ("run", "tokens", "seconds", "tok/s", "TTFT ms", "decode tok/s", "J/token"):
        table.add_column(name, justify="right")
    for run in result.runs:
        if not run.ok:
            table.add_row(str(run.index), "failed", run.error[:40], "", "", "", "")
            continue
        table.add_row(
            str(run.index),
            f"{run.output_tokens:.0f}",
            f"{run.seconds:.2f}",
            f"{run.tok_s:.1f}",
            _fmt(run.ttft_s, 1e3),
            _fmt(run.decode_tok_s),
            _fmt(run.energy.get("j_per_token"), digits=3),
        )
    console.print(table)
    console.print(format_tok_s_summary(result.tok_s))
    if result.energy.get("energy_j") is not None:
        console.print(
            f"energy {result.energy['energy_j']:.1f} J, mean {result.energy['mean_power_w']:.0f} W, "
            f"{_fmt(result.energy['j_per_token'], digits=3)} J/token"
        )
    _print_spec(result.spec, console)
    if show_notes:
        _print_notes(result.notes, console)


def print_sweep(result, console: Console | None = None) -> None:
    """One row per concurrency level of a SweepResult: throughput, achieved concurrency, latencies."""
    console = console or Console()
    table = Table(title=f"sweep: {result.label}" + (" (interrupted)" if result.interrupted else ""))
    with_energy = any(p.energy.get("j_per_token") is not None for p in result.points)
    columns = ("C", "got C", "req/s", "tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
               "ITL p50/p99 ms", "E2E p50/p99 s", *(["J/tok"] if with_energy else []), "valid")  # fmt: skip
    for name in columns:
        table.add_column(name, justify="right")
    for p in result.points:
        pooled, tput = p.pooled, p.tput
        half = f" ±{_fmt((tput.ci_high - tput.ci_low) / 2)}" if tput.n > 1 else ""
        energy = (_fmt(p.energy.get("j_per_token"), digits=3),) if with_energy else ()
        table.add_row(
            str(p.concurrency),
            _fmt(pooled.achieved_concurrency),
            _fmt(pooled.requests_per_s, digits=2),
            f"{_fmt(tput.mean)}{half}",
            "/".join(_fmt(pooled.ttft_s.get(f"p{q}"), 1e3) for q in (50, 99)),
            "/".join(_fmt(pooled.tpot_s.get(f"p{q}"), 1e3, 2) for q in (50, 99)),
            "/".join(_fmt(pooled.itl_s.get(f"p{q}"), 1e3, 2) for q in (50, 99)),
            "/".join(_fmt(pooled.e2e_s.get(f"p{q}"), 1.0, 2) for q in (50, 99)),
            *energy,
            "yes" if p.valid else f"[red]no ({p.pooled.num_failed} failed)[/red]",
        )
    console.print(table)
    for p in result.points:
        _print_spec(p.spec, console, prefix=f"C={p.concurrency}: ")
    _print_notes(result.notes, console)


def print_crossover(label_a: str, label_b: str, crossover, console: Console | None = None) -> None:
    """The ratio B/A per concurrency with its CI, and the crossover concurrency."""
    console = console or Console()
    table = Table(title=f"{label_b} / {label_a}: output tok/s ratio ({crossover.confidence:.0%} CI)")
    for name in ("C", "ratio", "CI low", "CI high", "paired", "valid"):
        table.add_column(name, justify="right")
    for r in crossover.rows:
        table.add_row(
            str(r.concurrency),
            f"{r.ratio:.3f}",
            _fmt(r.ci_low, digits=3),
            _fmt(r.ci_high, digits=3),
            "yes" if r.paired else "no",
            "yes" if r.valid else "no",
        )
    console.print(table)
    if crossover.concurrency is None:
        console.print(
            f"no crossover: {label_b} never fell below {label_a} with {crossover.confidence:.0%} confidence"
        )
    else:
        console.print(
            f"crossover at concurrency {crossover.concurrency}: from there {label_b} is slower than {label_a}"
        )


def _print_spec(spec: dict, console: Console, prefix: str = "") -> None:
    if "acceptance_length" in spec:
        rate = spec.get("acceptance_rate")
        extra = f", acceptance rate {rate:.2f}" if rate is not None else ""
        console.print(
            f"{prefix}speculative decoding: acceptance length {spec['acceptance_length']:.2f}{extra}"
        )


def _print_notes(notes: list[str], console: Console) -> None:
    for note in notes:
        style = "yellow" if note.startswith(("warning", "interrupted")) or "warning" in note else "dim"
        console.print(f"[{style}]{note}[/{style}]")


class SweepProgress:
    """A rich progress bar fed by the sweep's progress callback; use as a context manager."""

    def __init__(self, console: Console | None = None):
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
            transient=True,
        )
        self._tasks: dict = {}

    def __enter__(self) -> SweepProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()

    def __call__(self, label: str, concurrency: int, done: int, total: int) -> None:
        key = (label, concurrency)
        if key not in self._tasks:
            self._tasks[key] = self._progress.add_task(f"{label} C={concurrency}", total=total)
        task = self._tasks[key]
        if done == 1:
            self._progress.reset(task, total=total)
        self._progress.update(task, completed=done)
