"""Benchmark harness: speaks HTTP to any OpenAI-compatible server (tpfuse, SGLang, vLLM, ...).

Programmatic use (e.g. `tpfuse demo`):
    result = run_single("http://127.0.0.1:30000", SingleConfig(warmups=1, runs=2, max_tokens=64))
    print_single(result)
    sweep = run_sweep("http://127.0.0.1:30000", SweepConfig(concurrencies=(1, 2), repeats=1, max_tokens=16))
    print_sweep(sweep)
Names are imported lazily so `tpfuse --help` does not pay for httpx, rich and matplotlib.
"""

import importlib

_EXPORTS = {
    "run_single": "tpfuse.bench.runs",
    "SingleConfig": "tpfuse.bench.runs",
    "SingleResult": "tpfuse.bench.runs",
    "run_sweep": "tpfuse.bench.sweep",
    "run_paired_sweeps": "tpfuse.bench.sweep",
    "SweepConfig": "tpfuse.bench.sweep",
    "SweepResult": "tpfuse.bench.sweep",
    "find_crossover": "tpfuse.bench.compare",
    "BenchOptions": "tpfuse.bench.session",
    "ClientConfig": "tpfuse.bench.client",
    "PromptConfig": "tpfuse.bench.prompts",
    "ServerUnreachable": "tpfuse.bench.client",
    "ServerRejected": "tpfuse.bench.client",
    "print_single": "tpfuse.bench.report",
    "print_sweep": "tpfuse.bench.report",
    "print_crossover": "tpfuse.bench.report",
    "write_single": "tpfuse.bench.outputs",
    "write_sweep": "tpfuse.bench.outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tpfuse.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
