"""The TPFUSE_* environment knobs, read from the environment in this one place.

`current` holds the values read when tpfuse was imported (a worker process reads its own at start-up);
`reload()` reads them again (tests that change the environment call it). Hot paths read an attribute
of `current`, never os.environ. Values are kept as given; the module that uses a knob validates it
where it takes effect and names the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

KERNELS = "TPFUSE_KERNELS"  # "torch" | "triton" force one implementation; else by device
LINEAR = "TPFUSE_LINEAR"  # "auto" | "triton" | "cublas": projection routes (model/linear_choice.py)
LINEAR_MARGIN = "TPFUSE_LINEAR_MARGIN"  # share of cuBLAS's time a Triton route may need
PEER_MEMORY = "TPFUSE_PEER_MEMORY"  # "symm_mem" | "cuda_ipc": try only that peer-memory backend
COMM_CHECK = "TPFUSE_COMM_CHECK"  # "1": synchronise and check the error word after every collective
STEP_TIMEOUT = "TPFUSE_STEP_TIMEOUT_S"  # seconds a TP worker may take to run a step before rank 0 stops
PDL = "TPFUSE_PDL"  # "0": no programmatic dependent launch (kernels/pdl.py)


@dataclass(frozen=True)
class Knobs:
    kernels: str = "auto"
    linear: str = "auto"
    linear_margin: str | None = None
    peer_memory: str | None = None
    comm_check: bool = False
    step_timeout_s: str | None = None
    pdl: bool = True


def read() -> Knobs:
    env = os.environ
    return Knobs(
        kernels=env.get(KERNELS, "auto"),
        linear=env.get(LINEAR, "auto"),
        linear_margin=env.get(LINEAR_MARGIN),
        peer_memory=env.get(PEER_MEMORY) or None,
        comm_check=env.get(COMM_CHECK) == "1",
        step_timeout_s=env.get(STEP_TIMEOUT),
        pdl=env.get(PDL) != "0",
    )


current: Knobs = read()


def reload() -> Knobs:
    """Reads the environment again into `current` and returns it."""
    global current
    current = read()
    return current
