"""Named topologies for the cost model (`tpfuse comm-model --topology NAME`). Each figure's origin is
in docs/PCIE.md: published measurements where they exist, fitted parameters marked as such, and
assumptions for the rest."""

from __future__ import annotations

import json

from tpfuse.comm.cost_model import NcclModel, PathModel, TopologyModel

# PCIe Gen5 x16 per direction; peer writes 53-56 GB/s inside a socket, 39-51 across; peer write
# latency 0.36-0.45 us (the published RTX PRO 6000 figures). Reads: b12x's 52 GB/s inside;
# across and both read latencies are assumptions (read = 0.9 x write across; a read is a round trip).
_PCIE_INSIDE = PathModel(write_gbps=55.0, read_gbps=52.0, write_latency_us=0.36, read_latency_us=0.72)
_PCIE_ACROSS = PathModel(write_gbps=45.0, read_gbps=40.5, write_latency_us=0.45, read_latency_us=0.90)
# NCCL on those hosts, fitted to three of the five published figures (8 ranks, hidden 6144, bf16):
# ring_gbps from the slope between 128 and 512 rows (123.2 -> 294.4 us; 48.2 GB/s falls inside the
# published 39-51 GB/s across sockets), the Simple step from 512 rows, the LL step from 1 row (59.7 us).
# 8 and 32 rows are the checks (docs/PCIE.md).
_PCIE_NCCL = NcclModel(ring_gbps=48.23, ll_step_us=4.20, simple_step_us=4.72)


# One flag round (release fence + posted flag + poll + skew) on these hosts: an assumption set to 3.0 us
# so that the one-shot / two-shot crossover falls inside the published 32-48 KB at 8 ranks.
PCIE_ROUND_US = 3.0


def _pcie_host(name, islands, description, round_us=PCIE_ROUND_US, collapse=1.0):
    return TopologyModel(
        name=name, islands=islands, inside=_PCIE_INSIDE, across=_PCIE_ACROSS, link_gbps=63.0, kernel_us=1.0,
        round_us=round_us, nccl=_PCIE_NCCL, norm_kernel_us=2.5, collapse_factor=collapse,
        description=description,
    )  # fmt: skip


NAMED = {
    "rtx-pro-6000-8x-2socket": _pcie_host(
        "rtx-pro-6000-8x-2socket", ((0, 1, 2, 3), (4, 5, 6, 7)),
        "8x RTX PRO 6000 Blackwell, PCIe Gen5 x16, no NVLink, 4 GPUs per CPU socket",
    ),
    "rtx-pro-6000-8x-2socket-collapse": _pcie_host(
        "rtx-pro-6000-8x-2socket-collapse", ((0, 1, 2, 3), (4, 5, 6, 7)),
        "the same host where fan-out peer writes across root complexes keep 15% of their bandwidth "
        "(the published 75-93% loss, middle)", collapse=0.15,
    ),
    "rtx-pro-6000-4x": _pcie_host(
        "rtx-pro-6000-4x", ((0, 1, 2, 3),), "4x RTX PRO 6000 Blackwell on one CPU socket, PCIe Gen5 x16",
    ),
    "h200-8x-nvlink": TopologyModel(
        name="h200-8x-nvlink", islands=(tuple(range(8)),),
        inside=PathModel(write_gbps=350.0, read_gbps=330.0, write_latency_us=0.8, read_latency_us=1.6),
        across=PathModel(write_gbps=350.0, read_gbps=330.0, write_latency_us=0.8, read_latency_us=1.6),
        link_gbps=450.0, kernel_us=1.0, round_us=1.5,
        nccl=NcclModel(ring_gbps=330.0, ll_step_us=0.8, simple_step_us=1.2), norm_kernel_us=2.0,
        description="8x H200 SXM on NVSwitch (450 GB/s per direction per GPU); not checked against "
        "measurements (assumed figures)",
    ),
}  # fmt: skip


def load_topology(name_or_path: str) -> TopologyModel:
    """A named topology (topologies.NAMED) or a JSON file of TopologyModel.to_json's form."""
    if name_or_path in NAMED:
        return NAMED[name_or_path]
    try:
        with open(name_or_path) as f:
            return TopologyModel.from_json(json.load(f))
    except FileNotFoundError:
        raise ValueError(
            f"unknown topology {name_or_path!r}: name one of {', '.join(NAMED)} or give a JSON file"
        ) from None
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"topology file {name_or_path!r} is not a TopologyModel JSON: {exc}") from None
