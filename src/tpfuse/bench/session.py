"""What every benchmark mode shares: options, the client tokenizer, telemetry and environment info."""

from __future__ import annotations

import platform
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

from tpfuse.bench.client import ClientConfig
from tpfuse.bench.prompts import PromptConfig
from tpfuse.bench.telemetry import GpuTelemetry
from tpfuse.bench.tokenizer import load_client_tokenizer

TELEMETRY_MODES = ("auto", "on", "off")


@dataclass(slots=True)
class BenchOptions:
    """Options common to single, sweep and compare."""

    client: ClientConfig
    prompts: PromptConfig = field(default_factory=PromptConfig)
    tokenizer: str | None = None  # None: try the served model name (a local dir or a tpfuse preset)
    ready_timeout_s: float = 30.0
    gpu_telemetry: str = "auto"  # auto: on when the server's host is this machine
    gpus: list[int] | None = None
    telemetry_interval_s: float = 0.05
    confidence: float = 0.95
    label: str | None = None  # configuration name in tables and plots

    def __post_init__(self):
        if self.gpu_telemetry not in TELEMETRY_MODES:
            raise ValueError(f"--gpu-telemetry must be one of {', '.join(TELEMETRY_MODES)}")
        if self.ready_timeout_s <= 0:
            raise ValueError(f"--ready-timeout must be > 0 seconds, got {self.ready_timeout_s}")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"--confidence must lie in (0, 1), got {self.confidence}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["client"].pop("api_key", None)
        return d


class SavedResult:
    """Base of every mode's result (SingleResult, SweepResult): the summary keys that say how and where
    it was measured, the same in every mode. Subclasses have the attributes interrupted, config,
    options (BenchOptions.to_dict()), environment and notes."""

    def provenance(self) -> dict:
        """interrupted, config, seed, options, environment, notes: in this order in the summary."""
        return {
            "interrupted": self.interrupted,
            "config": self.config,
            "seed": self.options["prompts"]["seed"],
            "options": self.options,
            "environment": self.environment,
            "notes": self.notes,
        }


def is_local_url(url: str) -> bool:
    """Whether the server at `url` runs on this machine (so its GPUs are ours to read)."""
    host = urlparse(url).hostname or ""
    local = {"localhost", "127.0.0.1", "::1", "0.0.0.0", socket.gethostname(), socket.getfqdn()}
    return host in local or host.startswith("127.")


def make_telemetry(options: BenchOptions) -> tuple[GpuTelemetry | None, str]:
    """Telemetry per --gpu-telemetry, and a note for the report."""
    if options.gpu_telemetry == "off":
        return None, "GPU telemetry off (--gpu-telemetry off)"
    if options.gpu_telemetry == "auto" and not is_local_url(options.client.url):
        return None, "no GPU telemetry: the server is not on this machine (--gpu-telemetry on forces it)"
    telemetry = GpuTelemetry(options.gpus, options.telemetry_interval_s)
    if not telemetry.available:
        return None, telemetry.note
    return telemetry, f"GPU telemetry: NVML on GPUs {sorted(telemetry.describe()['gpus'])}"


def load_tokenizer_for(options: BenchOptions):
    """(tokenizer or None, note): --tokenizer, else the served model's name once it is known."""
    return load_client_tokenizer(options.tokenizer or options.client.model)


def environment(telemetry: GpuTelemetry | None) -> dict:
    """Versions and host facts recorded with every result."""
    import httpx

    try:
        from importlib.metadata import version

        tpfuse_version = version("tpfuse")
    except Exception:  # not installed as a distribution (source checkout on PYTHONPATH)
        tpfuse_version = "source"
    return {
        "tpfuse": tpfuse_version,
        "python": sys.version.split()[0],
        "httpx": httpx.__version__,
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "gpu": telemetry.describe() if telemetry is not None else None,
    }
