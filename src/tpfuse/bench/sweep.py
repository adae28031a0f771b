"""Closed-loop concurrency sweeps, and the crossover of two paired sweeps.

Each level C is warmed up at its own concurrency (C requests, one per slot), then measured R times
with at least 5 x C requests per repeat. Several configurations ("sides") run interleaved level by
level and repeat by repeat, so slow drift of the machine hits both alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tpfuse.bench.client import ClientConfig, RequestRecord, StreamingClient
from tpfuse.bench.load import connect, run_closed_loop
from tpfuse.bench.metrics import WindowSummary, summarize_window, token_count_warning
from tpfuse.bench.prompts import load_prompts
from tpfuse.bench.server_metrics import scrape_spec_metrics, spec_deltas
from tpfuse.bench.session import BenchOptions, SavedResult, environment, load_tokenizer_for, make_telemetry
from tpfuse.bench.stats import Summary, summarize
from tpfuse.bench.telemetry import GpuTelemetry, energy_summary

DEFAULT_CONCURRENCIES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_REQUESTS_PER_SLOT = 5


@dataclass(slots=True)
class SweepConfig:
    concurrencies: tuple[int, ...] = DEFAULT_CONCURRENCIES
    requests_per_level: int | None = None  # per repeat; raised to at least 5 x C
    repeats: int = 3
    max_tokens: int = 256
    warmup_requests: int | None = None  # per level; None: C

    def __post_init__(self):
        self.concurrencies = tuple(self.concurrencies)
        if not self.concurrencies or any(c < 1 for c in self.concurrencies):
            raise ValueError(f"--concurrency levels must be >= 1, got {list(self.concurrencies)}")
        self.concurrencies = tuple(sorted(set(self.concurrencies)))
        if self.requests_per_level is not None and self.requests_per_level < 1:
            raise ValueError(f"--requests-per-level must be >= 1, got {self.requests_per_level}")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.warmup_requests is not None and self.warmup_requests < 0:
            raise ValueError(f"--warmup-requests must be >= 0, got {self.warmup_requests}")

    def requests_at(self, concurrency: int) -> int:
        return max(self.requests_per_level or 0, MIN_REQUESTS_PER_SLOT * concurrency)

    def warmups_at(self, concurrency: int) -> int:
        return concurrency if self.warmup_requests is None else self.warmup_requests


@dataclass
class SweepPoint:
    """One concurrency level of one configuration. `pooled` holds latency percentiles over every
    repeat's requests and per-repeat means of the throughput figures; `tput` summarizes output tok/s
    across repeats. A point with any failed request is invalid."""

    label: str
    concurrency: int
    repeats: list[WindowSummary]
    pooled: WindowSummary
    tput: Summary
    energy: dict = field(default_factory=dict)
    spec: dict = field(default_factory=dict)
    window_s: tuple[float, float] = (0.0, 0.0)  # on the telemetry clock

    @property
    def valid(self) -> bool:
        return all(r.valid for r in self.repeats)

    def to_dict(self) -> dict:
        return {
            "label": self.label,
            "concurrency": self.concurrency,
            "valid": self.valid,
            "output_tok_s": self.tput.to_dict(),
            "output_tok_s_repeats": [r.output_tok_s for r in self.repeats],
            "pooled": self.pooled.to_dict(),
            "repeats": [r.to_dict() for r in self.repeats],
            "energy": self.energy,
            "spec_decoding": self.spec,
            "window_s": list(self.window_s),
        }


def pool_repeats(label: str, concurrency: int, windows: list[list[RequestRecord]], confidence: float):
    repeats = [summarize_window(w) for w in windows]
    pooled = summarize_window([r for w in windows for r in w])
    pooled = dataclasses.replace(
        pooled,
        wall_s=sum(r.wall_s for r in repeats),
        output_tok_s=_mean([r.output_tok_s for r in repeats]),
        requests_per_s=_mean([r.requests_per_s for r in repeats]),
        achieved_concurrency=_mean([r.achieved_concurrency for r in repeats]),
    )
    tput = summarize([r.output_tok_s for r in repeats], confidence)
    return SweepPoint(label, concurrency, repeats, pooled, tput)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass
class SweepResult(SavedResult):
    label: str
    options: dict
    config: dict
    environment: dict
    notes: list[str]
    points: list[SweepPoint]
    records: list[dict]  # RequestRecord dicts tagged with label, concurrency, repeat
    samples: list = field(default_factory=list)
    interrupted: bool = False

    def summary_dict(self) -> dict:
        return {
            "mode": "sweep",
            "label": self.label,
            **self.provenance(),
            "points": [p.to_dict() for p in self.points],
        }


@dataclass
class _Side:
    options: BenchOptions
    label: str
    tokenizer: object
    notes: list[str]
    points: list[SweepPoint] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)


ProgressFn = Callable[[str, int, int, int], None]  # (label, concurrency, done, total)


def _prepare_side(options: BenchOptions, default_label: str) -> _Side:
    notes = []
    probe = load_prompts(options.prompts, 1, options.client.endpoint == "completions")[0]
    notes += asyncio.run(connect(options.client, probe, options.ready_timeout_s))
    tokenizer, tokenizer_note = load_tokenizer_for(options)
    notes.append(tokenizer_note)
    return _Side(options, options.label or options.client.model or default_label, tokenizer, notes)


def _level_prompts(side: _Side, concurrency: int, count: int) -> list:
    # Seeded by level only, so paired sides send identical prompts in identical order.
    config = dataclasses.replace(side.options.prompts, seed=side.options.prompts.seed + concurrency)
    return load_prompts(config, count, side.options.client.endpoint == "completions", side.tokenizer)


async def _measure_level(
    sides: list[_Side],
    concurrency: int,
    config: SweepConfig,
    telemetry: GpuTelemetry | None,
    progress: ProgressFn | None,
) -> None:
    per_repeat, warmups = config.requests_at(concurrency), config.warmups_at(concurrency)
    clients = [StreamingClient(s.options.client, concurrency, s.tokenizer) for s in sides]
    try:
        prompts = [_level_prompts(s, concurrency, warmups + per_repeat * config.repeats) for s in sides]
        for client, p in zip(clients, prompts, strict=True):
            await run_closed_loop(
                client, p[:warmups], concurrency, config.max_tokens, first_request_id=-warmups
            )
        windows: list[list[list[RequestRecord]]] = [[] for _ in sides]
        joules: list[float | None] = [0.0 for _ in sides]
        before = [
            await scrape_spec_metrics(c.http, s.options.client.url)
            for c, s in zip(clients, sides, strict=True)
        ]
        start = telemetry.now_s() if telemetry else 0.0
        for repeat in range(config.repeats):
            for k, (side, client) in enumerate(zip(sides, clients, strict=True)):
                lo = warmups + repeat * per_repeat
                done = [0]

                def tick(_record, side=side, done=done):
                    done[0] += 1
                    if progress is not None:
                        progress(side.label, concurrency, done[0], per_repeat)

                energy_before = telemetry.read_energy_mj() if telemetry else None
                records = await run_closed_loop(
                    client, prompts[k][lo : lo + per_repeat], concurrency, config.max_tokens, tick, lo
                )
                used = GpuTelemetry.energy_between(
                    energy_before, telemetry.read_energy_mj() if telemetry else None
                )
                joules[k] = None if used is None or joules[k] is None else joules[k] + used
                windows[k].append(records)
                side.records += [
                    r.to_dict() | {"label": side.label, "concurrency": concurrency, "repeat": repeat}
                    for r in records
                ]
        end = telemetry.now_s() if telemetry else 0.0
        for k, (side, client) in enumerate(zip(sides, clients, strict=True)):
            point = pool_repeats(side.label, concurrency, windows[k], side.options.confidence)
            point.energy = energy_summary(joules[k], point.pooled.wall_s, point.pooled.output_tokens)
            point.spec = spec_deltas(
                before[k], await scrape_spec_metrics(client.http, side.options.client.url)
            )
            point.window_s = (start, end)
            warning = token_count_warning([r for w in windows[k] for r in w])
            if warning:
                side.notes.append(f"C={concurrency}: warning: {warning}")
            side.points.append(point)
    finally:
        for client in clients:
            await client.aclose()


def _run_levels(sides, config, telemetry, progress, after_level: Callable[[], None] | None) -> bool:
    """Measure every level for every side; returns True when Ctrl-C cut it short."""

    async def main() -> None:
        for concurrency in config.concurrencies:
            await _measure_level(sides, concurrency, config, telemetry, progress)
            if after_level is not None:
                after_level()

    if telemetry:
        telemetry.start()
    try:
        asyncio.run(main())
        return False
    except KeyboardInterrupt:
        for side in sides:
            side.notes.append(f"interrupted: kept the {len(side.points)} finished points")
        return True
    finally:
        if telemetry:
            telemetry.stop()


def _result(side: _Side, config, telemetry, notes, interrupted) -> SweepResult:
    finished = {p.concurrency for p in side.points}
    return SweepResult(
        label=side.label,
        options=side.options.to_dict(),
        config=dataclasses.asdict(config),
        environment=environment(telemetry),
        notes=notes + side.notes,
        points=side.points,
        records=[r for r in side.records if r["concurrency"] in finished],
        samples=list(telemetry.samples) if telemetry else [],
        interrupted=interrupted,
    )


def run_sweep(
    options: BenchOptions | str,
    config: SweepConfig | None = None,
    progress: ProgressFn | None = None,
    on_point: Callable[[SweepResult], None] | None = None,
) -> SweepResult:
    """Sweep concurrency levels against one server (`options` or a bare URL).

    `progress(label, concurrency, done, total)` fires after each measured request, `on_point(result
    so far)` after each level (to save partial results). Ctrl-C keeps the finished levels
    (`interrupted` set). Raises ServerUnreachable / ServerRejected when the server cannot be used.
    """
    options = BenchOptions(ClientConfig(url=options)) if isinstance(options, str) else options
    config = config or SweepConfig()
    telemetry, note = make_telemetry(options)
    side = _prepare_side(options, "server")

    def after_level() -> None:
        if on_point is not None:
            on_point(_result(side, config, telemetry, [note], False))

    interrupted = _run_levels([side], config, telemetry, progress, after_level)
    return _result(side, config, telemetry, [note], interrupted)


def run_paired_sweeps(
    options_a: BenchOptions,
    options_b: BenchOptions,
    config: SweepConfig,
    progress: ProgressFn | None = None,
    on_point: Callable[[SweepResult, SweepResult], None] | None = None,
) -> tuple[SweepResult, SweepResult, bool]:
    """Sweep two servers interleaved (same prompts, same order); returns (a, b, interrupted).

    `on_point(a so far, b so far)` fires after each level. Ctrl-C keeps the finished levels.
    """
    telemetry, note = make_telemetry(options_a)
    side_a = _prepare_side(options_a, "A")
    side_b = _prepare_side(options_b, "B")
    if side_a.label == side_b.label:
        side_a.label, side_b.label = f"A: {side_a.label}", f"B: {side_b.label}"

    def after_level() -> None:
        if on_point is not None:
            on_point(*(_result(s, config, telemetry, [note], False) for s in (side_a, side_b)))

    interrupted = _run_levels([side_a, side_b], config, telemetry, progress, after_level)
    return (
        _result(side_a, config, telemetry, [note], interrupted),
        _result(side_b, config, telemetry, [note], interrupted),
        interrupted,
    )
