"""On the GPU machine: NVML telemetry for real, and a bench session against `tpfuse serve` on CUDA."""

import time

import pytest

from tpfuse.bench.telemetry import GpuTelemetry


def _busy_gpu(seconds: float) -> None:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


@pytest.mark.gpu
def test_nvml_energy_delta_matches_sampled_power_during_gpu_work():
    telemetry = GpuTelemetry(interval_s=0.05)
    assert telemetry.available, telemetry.note
    telemetry.start()
    t0, before = telemetry.now_s(), telemetry.read_energy_mj()
    _busy_gpu(3.0)
    t1, after = telemetry.now_s(), telemetry.read_energy_mj()
    telemetry.stop()
    joules = GpuTelemetry.energy_between(before, after)
    samples = telemetry.samples_between(t0, t1)
    gpus = {s.gpu for s in samples}
    rate = len(samples) / len(gpus) / (t1 - t0)
    sampled_w = sum(s.power_w for s in samples) / len(samples) * len(gpus)
    clock = max(s.sm_clock_mhz for s in samples)
    print(f"energy {joules:.0f} J in {t1 - t0:.2f} s = {joules / (t1 - t0):.0f} W; sampled {sampled_w:.0f} W")
    print(f"{rate:.1f} samples/s per GPU; SM clock max {clock:.0f} MHz")
    assert rate >= 10.0
    assert joules > 0
    # NVML's power reading is a trailing average, so agree within a factor of two only.
    assert 0.5 < (joules / (t1 - t0)) / sampled_w < 2.0
    assert max(s.utilization_pct for s in samples) > 50


@pytest.mark.gpu
def test_single_against_tpfuse_on_cuda_reports_energy_per_token(tmp_path):
    from tpfuse.bench.client import ClientConfig
    from tpfuse.bench.outputs import write_single
    from tpfuse.bench.runs import SingleConfig, run_single
    from tpfuse.bench.session import BenchOptions
    from tpfuse.server.launcher import ServerSubprocess

    with ServerSubprocess(["--device", "cuda", "--model", "tiny"], start_timeout=300) as server:
        options = BenchOptions(ClientConfig(url=server.url), gpu_telemetry="auto")
        result = run_single(options, SingleConfig(warmups=1, runs=3, max_tokens=256))
    assert result.valid, [r.error for r in result.runs]
    assert [rec.completion_tokens for rec in result.records] == [256, 256, 256]
    assert result.energy["j_per_token"] is not None and result.energy["j_per_token"] > 0
    assert result.samples, "telemetry sampled nothing"
    paths = {p.name for p in write_single(result, tmp_path)}
    assert "power.png" in paths
    print(f"tiny on CUDA: {result.tok_s.mean:.1f} tok/s, {result.energy['j_per_token']:.4f} J/token")
