"""SpinErrorWatch: a spin timeout recorded in the custom all-reduce's error word stops the engine with
an error naming the ranks that never arrived; a poll reads only a copy enqueued by an earlier poll."""

import pytest
import torch

from tpfuse.comm.communicator import SingleRankCommunicator
from tpfuse.comm.hybrid import create_virtual_communicators
from tpfuse.comm.sync import CTRL_ERROR
from tpfuse.engine.spin_errors import SpinErrorWatch


def _rank0(world_size: int):
    comms = create_virtual_communicators(world_size, "cpu", max_tokens=2, hidden_size=8, dtype=torch.float32)
    return comms[0]


def test_a_set_error_bit_raises_naming_the_missing_rank_on_the_poll_after_its_copy():
    comm = _rank0(3)
    watch = SpinErrorWatch(comm, rank=0, interval_s=0.0)
    watch.poll()  # takes the first copy: a clean word
    watch.poll()  # reads it, takes the next
    comm.workspace.words[CTRL_ERROR.value] = 0b100
    watch.poll()  # reads the copy taken before the bit was set, takes one with the bit
    with pytest.raises(RuntimeError, match=r"rank 2 never arrived in a tpfuse all-reduce of rank 0"):
        watch.poll()


def test_no_copy_is_taken_before_the_interval_has_passed():
    comm = _rank0(2)
    comm.workspace.words[CTRL_ERROR.value] = 0b10
    watch = SpinErrorWatch(comm, rank=0, interval_s=3600.0)
    for _ in range(3):
        watch.poll()  # the first copy is due in an hour
    assert watch.host.tolist() == [0]


def test_communicators_without_a_workspace_have_nothing_to_watch():
    SpinErrorWatch(SingleRankCommunicator(), rank=0, interval_s=0.0).poll()
