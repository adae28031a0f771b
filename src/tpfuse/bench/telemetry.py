"""GPU telemetry over NVML: energy-counter deltas per measured window, and sampled power, SM clock,
utilization and memory at >= 10 Hz in a background thread.

Without pynvml (nvidia-ml-py) or a GPU, `available` is False and `note` says why; nothing raises.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(slots=True)
class GpuSample:
    t_s: float  # seconds since the telemetry started
    gpu: int
    power_w: float | None
    sm_clock_mhz: float | None
    utilization_pct: float | None
    memory_used_mib: float | None


def _load_nvml():
    try:
        import pynvml
    except ImportError:
        return None, "no GPU telemetry: nvidia-ml-py (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError subclasses: no driver, no GPU
        return None, f"no GPU telemetry: NVML did not start ({e})"
    return pynvml, ""


class GpuTelemetry:
    """NVML telemetry for `gpus` (indices; None: every GPU). `nvml` may be injected (tests)."""

    def __init__(self, gpus: list[int] | None = None, interval_s: float = 0.05, nvml=None):
        if not 0 < interval_s <= 0.1:
            raise ValueError(f"telemetry interval must lie in (0, 0.1] s (>= 10 Hz), got {interval_s}")
        self.interval_s = interval_s
        self.samples: list[GpuSample] = []
        self.note = ""
        self._nvml, self.note = (nvml, "") if nvml is not None else _load_nvml()
        self._handles: dict[int, object] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._origin = time.perf_counter()
        if self._nvml is None:
            return
        try:
            count = self._nvml.nvmlDeviceGetCount()
            for index in gpus if gpus is not None else range(count):
                if not 0 <= index < count:
                    raise ValueError(f"--gpus names GPU {index}, but NVML sees {count} GPUs")
                self._handles[index] = self._nvml.nvmlDeviceGetHandleByIndex(index)
        except ValueError:
            raise
        except Exception as e:  # NVML errors on odd drivers: degrade to no telemetry
            self._handles = {}
            self.note = f"no GPU telemetry: NVML failed listing GPUs ({e})"
        if not self._handles and not self.note:
            self.note = "no GPU telemetry: NVML sees no GPU"

    @property
    def available(self) -> bool:
        return bool(self._handles)

    def describe(self) -> dict:
        """GPU names and driver version, for the JSON's environment section."""
        if not self.available:
            return {"note": self.note}
        names = {}
        for index, handle in self._handles.items():
            names[index] = self._call(self._nvml.nvmlDeviceGetName, handle)
        return {"gpus": names, "driver": self._call(self._nvml.nvmlSystemGetDriverVersion)}

    def start(self) -> None:
        """Start sampling in a daemon thread (no-op without telemetry)."""
        if not self.available or self._thread is not None:
            return
        self._origin = time.perf_counter()
        self._thread = threading.Thread(target=self._sample_loop, name="tpfuse-gpu-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=2.0)
            self._thread = None

    def now_s(self) -> float:
        """Seconds on the samples' clock."""
        return time.perf_counter() - self._origin

    def read_energy_mj(self) -> dict[int, int] | None:
        """Total energy counter of each GPU in millijoules; None when any GPU cannot report it."""
        if not self.available:
            return None
        readings = {}
        for index, handle in self._handles.items():
            value = self._call(self._nvml.nvmlDeviceGetTotalEnergyConsumption, handle)
            if value is None:
                return None
            readings[index] = int(value)
        return readings

    @staticmethod
    def energy_between(before: dict[int, int] | None, after: dict[int, int] | None) -> float | None:
        """Joules used by all GPUs between two readings; None when missing or a counter went back
        (a driver reset), since a delta across a reset is meaningless."""
        if not before or not after or before.keys() != after.keys():
            return None
        deltas = [after[i] - before[i] for i in before]
        if any(d < 0 for d in deltas):
            return None
        return sum(deltas) / 1000.0

    def samples_between(self, start_s: float, end_s: float) -> list[GpuSample]:
        return [s for s in self.samples if start_s <= s.t_s <= end_s]

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Exception:  # NVMLError_NotSupported and friends: the field is simply absent
            return None

    def _sample_once(self) -> None:
        nvml, t = self._nvml, self.now_s()
        for index, handle in self._handles.items():
            power = self._call(nvml.nvmlDeviceGetPowerUsage, handle)
            clock = self._call(nvml.nvmlDeviceGetClockInfo, handle, getattr(nvml, "NVML_CLOCK_SM", 1))
            util = self._call(nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = self._call(nvml.nvmlDeviceGetMemoryInfo, handle)
            self.samples.append(
                GpuSample(
                    t_s=t,
                    gpu=index,
                    power_w=power / 1000.0 if power is not None else None,
                    sm_clock_mhz=float(clock) if clock is not None else None,
                    utilization_pct=float(util.gpu) if util is not None else None,
                    memory_used_mib=memory.used / 2**20 if memory is not None else None,
                )
            )

    def _sample_loop(self) -> None:
        next_t = time.perf_counter()
        while not self._stop.is_set():
            self._sample_once()
            next_t += self.interval_s
            self._stop.wait(max(0.0, next_t - time.perf_counter()))


def energy_summary(joules: float | None, wall_s: float, output_tokens: float) -> dict:
    """{"energy_j", "mean_power_w", "j_per_token"}; None values when the energy is unknown."""
    if joules is None or wall_s <= 0:
        return {"energy_j": None, "mean_power_w": None, "j_per_token": None}
    return {
        "energy_j": joules,
        "mean_power_w": joules / wall_s,
        "j_per_token": joules / output_tokens if output_tokens > 0 else None,
    }
