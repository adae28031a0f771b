"""Whether the decode step launches its kernels with programmatic dependent launch (kernels/pdl.py),
chosen by measurement at start-up: the batch-1 decode graph captured with and without it, replayed
in alternation, PDL kept for the device where it is clearly faster (MARGIN), else launches stay
plain (the runner times its projection routes with plain launches before this). On one H200 PDL
made qwen3-30b-a3b's batch-1 step 1.19x faster; llama-3.1-8b's large GEMVs ran about 5 % slower
with it (gate_up 56.8 against 53.7 us, lm_head 242 against 231 us), enough to lose their routes to
cuBLAS (docs/PERF.md).

At TP > 1 the decode graph holds collectives whose extra captures and replays the ranks would have to
agree on, and no link has been measured, so launches stay plain there.
"""

from __future__ import annotations

import logging
import statistics

import torch

from tpfuse.engine.cuda_graphs import DecodeGraphs
from tpfuse.gpu_timing import stream_us
from tpfuse.kernels import pdl

log = logging.getLogger(__name__)

ROUNDS = 5
REPLAYS = 10
# PDL is kept only where its trial step takes at most this share of the plain one's. The trial replays
# one-token contexts back to back and credits PDL more than serving does: on the H200 llama-3.1-8b's
# trial gave 0.965 while its engine steps ran 1.03x slower with PDL; qwen3-30b-a3b's trial gave 0.83
# and its engine steps 0.84 (docs/PERF.md).
MARGIN = 0.95


def choose_pdl(graphs: DecodeGraphs | None, device: torch.device, tp_size: int) -> dict | None:
    """Sets pdl.choose for device from the batch-1 decode graph timed both ways (see the module doc).
    Returns {"pdl_us", "plain_us", "on"}, or None where nothing was timed and launches stay plain: at
    TP > 1, without graphs (eager) or where PDL is not supported."""
    if tp_size > 1:
        pdl.choose(device, False)
        return None
    if graphs is None or not pdl.supported(device):
        pdl.choose(device, False)
        return None
    timed = {}
    for on in (True, False):
        pdl.choose(device, on)
        graph, _ = graphs.capture_one(1, 0)
        timed[on] = graph
    times = {True: [], False: []}
    for round_ in range(ROUNDS):  # alternate, first side flipped every round
        for on in (True, False) if round_ % 2 == 0 else (False, True):
            times[on].append(stream_us(timed[on].replay, REPLAYS))
    del timed
    pdl_us, plain_us = statistics.median(times[True]), statistics.median(times[False])
    on = pdl_us <= MARGIN * plain_us
    pdl.choose(device, on)
    log.info(
        "decode launches %s programmatic dependent launch: batch-1 step %.1f us with it, %.1f us without",
        "with" if on else "without", pdl_us, plain_us,
    )  # fmt: skip
    return {"pdl_us": pdl_us, "plain_us": plain_us, "on": on}
