"""The careful single-stream method: W warm-up requests, then N runs of L tokens, one at a time;
per-run tok/s, then mean, stdev, coefficient of variation and a t-based confidence interval."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from tpfuse.bench.client import ClientConfig, RequestRecord, StreamingClient
from tpfuse.bench.load import connect
from tpfuse.bench.metrics import WindowSummary, request_metrics, summarize_window, token_count_warning
from tpfuse.bench.prompts import load_prompts
from tpfuse.bench.server_metrics import scrape_spec_metrics, spec_deltas
from tpfuse.bench.session import BenchOptions, SavedResult, environment, load_tokenizer_for, make_telemetry
from tpfuse.bench.stats import Summary, summarize
from tpfuse.bench.telemetry import GpuSample, GpuTelemetry, energy_summary


@dataclass(slots=True)
class SingleConfig:
    warmups: int = 2
    runs: int = 5
    max_tokens: int = 2048

    def __post_init__(self):
        if self.warmups < 0:
            raise ValueError(f"--warmups must be >= 0, got {self.warmups}")
        if self.runs < 1:
            raise ValueError(f"--runs must be >= 1, got {self.runs}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")


@dataclass(slots=True)
class RunResult:
    """One measured run. tok_s = output tokens / end-to-end seconds (TTFT included);
    decode_tok_s excludes the first token's wait (NaN when all tokens came in one chunk)."""

    index: int  # 1-based
    output_tokens: float
    seconds: float
    tok_s: float
    ttft_s: float
    decode_tok_s: float
    energy: dict = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class SingleResult(SavedResult):
    """Everything `tpfuse bench single` measured; `tok_s` is None when no run succeeded."""

    label: str
    options: dict
    config: dict
    environment: dict
    notes: list[str]
    runs: list[RunResult]
    tok_s: Summary | None
    window: WindowSummary
    energy: dict
    spec: dict
    records: list[RequestRecord]
    samples: list[GpuSample]
    interrupted: bool = False

    @property
    def valid(self) -> bool:
        return not self.interrupted and bool(self.runs) and all(r.ok for r in self.runs)

    def summary_dict(self) -> dict:
        return {
            "mode": "single",
            "label": self.label,
            "valid": self.valid,
            **self.provenance(),
            "tok_s": self.tok_s.to_dict() if self.tok_s else None,
            "runs": [asdict(r) for r in self.runs],
            "window": self.window.to_dict(),
            "energy": self.energy,
            "spec_decoding": self.spec,
        }


def run_result(index: int, record: RequestRecord, energy: dict) -> RunResult:
    m = request_metrics(record)
    if m is None:
        return RunResult(index, 0, 0.0, 0.0, 0.0, 0.0, energy, record.error or "no token received")
    decode_s = m.e2e_s - m.ttft_s
    # One chunk holding every token says nothing about decode speed.
    timed = len(record.chunk_times_s) > 1 and decode_s > 0 and m.output_tokens > 1
    decode = (m.output_tokens - 1) / decode_s if timed else math.nan
    return RunResult(index, m.output_tokens, m.e2e_s, m.output_tokens / m.e2e_s, m.ttft_s, decode, energy)


def run_single(
    options: BenchOptions | str,
    config: SingleConfig | None = None,
    on_run: Callable[[RunResult, int], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> SingleResult:
    """Run the single-stream method against `options` (or a bare server URL).

    `on_run(run, total)` is called after each measured run, `on_note(text)` for setup notes.
    Ctrl-C stops it early: the runs finished so far are kept and `interrupted` is set.
    Raises ServerUnreachable / ServerRejected when the server cannot be used at all.
    """
    options = BenchOptions(ClientConfig(url=options)) if isinstance(options, str) else options
    config = config or SingleConfig()
    notes: list[str] = []

    def note(text: str) -> None:
        notes.append(text)
        if on_note is not None:
            on_note(text)

    telemetry, telemetry_note = make_telemetry(options)
    note(telemetry_note)
    probe_prompt = load_prompts(options.prompts, 1, options.client.endpoint == "completions")[0]
    for text in asyncio.run(connect(options.client, probe_prompt, options.ready_timeout_s)):
        note(text)
    tokenizer, tokenizer_note = load_tokenizer_for(options)
    note(tokenizer_note)
    count = config.warmups + config.runs
    prompts = load_prompts(options.prompts, count, options.client.endpoint == "completions", tokenizer)

    records: list[RequestRecord] = []
    runs: list[RunResult] = []
    scrapes: dict = {}
    window: dict = {}

    async def measure() -> None:
        async with StreamingClient(options.client, 1, tokenizer) as client:
            for i in range(config.warmups):
                await client.send(-1 - i, prompts[i], config.max_tokens, time.perf_counter(), 0.0)
            scrapes["before"] = await scrape_spec_metrics(client.http, options.client.url)
            energy_start = telemetry.read_energy_mj() if telemetry else None
            window["start"] = telemetry.now_s() if telemetry else 0.0
            origin = time.perf_counter()
            for i in range(config.runs):
                before = telemetry.read_energy_mj() if telemetry else None
                scheduled = time.perf_counter() - origin
                record = await client.send(
                    i, prompts[config.warmups + i], config.max_tokens, origin, scheduled
                )
                joules = GpuTelemetry.energy_between(
                    before, telemetry.read_energy_mj() if telemetry else None
                )
                records.append(record)
                run = run_result(i + 1, record, {})
                run.energy = energy_summary(joules, run.seconds, run.output_tokens)
                runs.append(run)
                if on_run is not None:
                    on_run(run, config.runs)
            window["energy_j"] = GpuTelemetry.energy_between(
                energy_start, telemetry.read_energy_mj() if telemetry else None
            )
            window["end"] = telemetry.now_s() if telemetry else 0.0
            scrapes["after"] = await scrape_spec_metrics(client.http, options.client.url)

    interrupted = False
    if telemetry:
        telemetry.start()
    try:
        asyncio.run(measure())
    except KeyboardInterrupt:
        interrupted = True
        note(f"interrupted after {len(runs)} of {config.runs} runs; keeping those")
    finally:
        if telemetry:
            telemetry.stop()
    warning = token_count_warning(records)
    if warning:
        note("warning: " + warning)
    good = [r.tok_s for r in runs if r.ok]
    summary = summarize_window(records)
    return SingleResult(
        label=options.label or options.client.model or options.client.url,
        options=options.to_dict(),
        config=asdict(config),
        environment=environment(telemetry),
        notes=notes,
        runs=runs,
        tok_s=summarize(good, options.confidence) if good else None,
        window=summary,
        energy=energy_summary(window.get("energy_j"), summary.wall_s, summary.output_tokens),
        spec=spec_deltas(scrapes.get("before"), scrapes.get("after")),
        records=records,
        samples=list(telemetry.samples) if telemetry else [],
        interrupted=interrupted,
    )
