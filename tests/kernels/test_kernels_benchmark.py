"""benchmarks/kernels.py runs end to end (on CPU, tiny shapes, kernels under the interpreter), so its
one short GPU run is not lost to a typo."""

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "kernels.py"
TINY = dict(DEVICE="cpu", DTYPE=torch.float32, HIDDEN=64, INTER=48, HEADS=4, KV_HEADS=2, HEAD_DIM=16,
            VOCAB=100, BLOCK=4, LAYERS=2, TABLE_WIDTH=64, L2_DEFEAT_BYTES=1)  # fmt: skip


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("kernels_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, value in TINY.items():
        monkeypatch.setattr(module, name, value)

    def run_once(calls, min_launches=64, replays=10):
        for call in calls:
            call()
        return 1.0

    monkeypatch.setattr(module, "graph_us", run_once)
    return module


def test_benchmark_times_every_decode_op_and_the_step_before_and_after(bench):
    bench.bench_small_ops(batch=2)
    bench.bench_decode_attention(batch=2, context=23, sweep=True)
    bench.bench_decode_step(batch=1, context=23)
    ops = {row["op"] for row in bench.ROWS}
    step = "SMALL OPS PER DECODE STEP"
    assert {"fused_add_rmsnorm OLD (w late)", "fused_add_rmsnorm", "silu_and_mul", "rope_store_kv (fused)",
            "rope + store_kv OLD (2 launches)", "decode_attention OLD rule", "decode_attention",
            "decode_attention last split merges", f"{step} before", f"{step} after",
            f"{step} after, last split merges"} <= ops  # fmt: skip
    sweep = next(row for row in bench.ROWS if row["op"] == "decode_attention")["sweep"]
    assert set(sweep) >= {1, 2, 4, 8, 16, 32}
