"""What tensor-parallel ranks settle at start-up: one projection route table for all (rank 0 decides,
even where a rank's own timings would pick another kernel), device layouts the collectives support,
and a valid step timeout."""

import pytest
import torch

from tests.helpers.dist import run_distributed
from tpfuse import knobs
from tpfuse.engine.worker import check_device_layout, step_timeout_s


def _weights():
    torch.manual_seed(0)
    return [(torch.randn(37, 40).bfloat16(), None), (torch.randn(16, 37).bfloat16(), None)]


def _routes_per_rank(rank, world_size):
    from tpfuse.engine.tp_rank import rank0_decides
    from tpfuse.model import linear_choice
    from tpfuse.model.linear_choice import GEMV

    def rank_timings(weights, rows, route):  # rank 0: GEMV wins everywhere; rank 1: cuBLAS does
        if route is None:
            return 10.0
        return (9.0 if route == GEMV else 12.0) if rank == 0 else 11.0

    alone = linear_choice.choose(_weights(), max_rows=1, time_us=rank_timings)
    linear_choice.reset()
    agreed = linear_choice.choose(_weights(), max_rows=1, time_us=rank_timings, agree=rank0_decides())
    x = torch.randn(1, 40).bfloat16()
    return (
        [c.route for c in alone],
        [c.route for c in agreed],
        linear_choice.route(x, _weights()[0][0], None),
    )


def test_every_rank_takes_rank_0s_routes_even_when_its_own_timings_differ():
    (alone0, agreed0, used0), (alone1, agreed1, used1) = run_distributed(_routes_per_rank, 2)
    assert alone0 == ["gemv", "gemv"] and alone1 == [None, None]  # the injected timings differ
    assert agreed0 == agreed1 == ["gemv", "gemv"]
    assert used0 == used1 == "gemv"  # and the hot-path lookup follows the agreed table


@pytest.mark.parametrize("layout", [[0, 1, 1], [0, 0, 1, 1], [1, 0, 0]])
def test_layouts_where_only_some_ranks_share_a_gpu_are_refused_naming_the_fix(layout):
    with pytest.raises(ValueError, match="some ranks share a GPU and others do not.*--devices 0,1"):
        check_device_layout(layout)


@pytest.mark.parametrize("layout", [[0, 1], [0, 0], [3, 1, 2, 0], [2, 2, 2, 2]])
def test_one_rank_per_gpu_or_all_on_one_gpu_is_accepted(layout):
    check_device_layout(layout)


def test_the_step_timeout_knob_must_be_a_positive_number(monkeypatch):
    monkeypatch.setenv(knobs.STEP_TIMEOUT, "2.5")
    knobs.reload()
    assert step_timeout_s() == 2.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv(knobs.STEP_TIMEOUT, bad)
        knobs.reload()
        with pytest.raises(ValueError, match=f"TPFUSE_STEP_TIMEOUT_S='{bad}' must be a positive number"):
            step_timeout_s()
