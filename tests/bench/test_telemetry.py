"""GPU telemetry with an injected NVML double (the CPU machine has no GPU)."""

import time
from types import SimpleNamespace

import pytest

from tpfuse.bench.telemetry import GpuTelemetry, energy_summary


class FakeNvml:
    NVML_CLOCK_SM = 1

    def __init__(self, gpus=2):
        self.gpus = gpus
        self.energy_mj = [1_000_000] * gpus
        self.supports_energy = True

    def nvmlDeviceGetCount(self):
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return f"Fake GPU {h}"

    def nvmlSystemGetDriverVersion(self):
        return "999.0"

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if not self.supports_energy:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return self.energy_mj[h]

    def nvmlDeviceGetPowerUsage(self, h):
        return 300_000 + 1000 * h  # milliwatts

    def nvmlDeviceGetClockInfo(self, h, kind):
        assert kind == self.NVML_CLOCK_SM
        return 1980

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=97, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")


def test_energy_delta_sums_all_gpus_in_joules():
    nvml = FakeNvml()
    telemetry = GpuTelemetry(nvml=nvml)
    before = telemetry.read_energy_mj()
    nvml.energy_mj = [e + 500_000 for e in nvml.energy_mj]
    assert GpuTelemetry.energy_between(before, telemetry.read_energy_mj()) == pytest.approx(1000.0)


def test_energy_across_a_counter_reset_is_dropped():
    nvml = FakeNvml()
    telemetry = GpuTelemetry(nvml=nvml)
    before = telemetry.read_energy_mj()
    nvml.energy_mj[1] = 10
    assert GpuTelemetry.energy_between(before, telemetry.read_energy_mj()) is None


def test_gpu_without_an_energy_counter_reports_no_energy():
    nvml = FakeNvml()
    nvml.supports_energy = False
    assert GpuTelemetry(nvml=nvml).read_energy_mj() is None


def test_energy_summary_gives_mean_watts_and_joules_per_token():
    assert energy_summary(600.0, 2.0, 300) == {"energy_j": 600.0, "mean_power_w": 300.0, "j_per_token": 2.0}
    assert energy_summary(None, 2.0, 300)["j_per_token"] is None


def test_sampler_records_power_clock_and_utilization_at_10_hz_or_more():
    telemetry = GpuTelemetry(gpus=[1], interval_s=0.02, nvml=FakeNvml())
    telemetry.start()
    time.sleep(0.3)
    telemetry.stop()
    samples = telemetry.samples
    assert {s.gpu for s in samples} == {1}
    rate = (len(samples) - 1) / (samples[-1].t_s - samples[0].t_s)
    assert rate >= 10.0
    s = samples[0]
    assert (s.power_w, s.sm_clock_mhz, s.utilization_pct, s.memory_used_mib) == (301.0, 1980.0, 97.0, None)


def test_sampling_slower_than_10_hz_is_refused():
    with pytest.raises(ValueError, match=">= 10 Hz"):
        GpuTelemetry(interval_s=0.5, nvml=FakeNvml())


def test_asking_for_a_gpu_nvml_does_not_see_names_it():
    with pytest.raises(ValueError, match="--gpus names GPU 5, but NVML sees 2 GPUs"):
        GpuTelemetry(gpus=[5], nvml=FakeNvml())


def test_without_nvml_telemetry_is_unavailable_with_a_note_and_never_raises():
    telemetry = GpuTelemetry()  # the CPU machine: no driver
    if telemetry.available:
        pytest.fail("this test expects a machine without GPUs")
    assert telemetry.note.startswith("no GPU telemetry")
    assert telemetry.read_energy_mj() is None
    telemetry.start()
    telemetry.stop()
    assert telemetry.samples == []
