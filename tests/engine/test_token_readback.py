"""TokenReadback hands each batch row its sampled id, whether the ids come one per batch row (graph
argmax, padding rows after them) or one per sampling row (the sampler)."""

import torch

from tpfuse.engine.token_readback import TokenReadback


def test_ids_by_batch_row_skip_rows_that_did_not_sample_and_padding():
    readback = TokenReadback(torch.device("cpu"))
    pending = readback.start(torch.tensor([11, 12, 13, 0]), rows=[0, 2], by_row=True, num_rows=3)
    assert readback.wait(pending) == [11, None, 13]


def test_ids_by_sampling_row_land_on_their_batch_rows():
    readback = TokenReadback(torch.device("cpu"))
    pending = readback.start(torch.tensor([21, 23]), rows=[0, 2], by_row=False, num_rows=3)
    assert readback.wait(pending) == [21, None, 23]


def test_a_step_without_sampling_rows_gives_none_everywhere():
    readback = TokenReadback(torch.device("cpu"))
    pending = readback.start(None, rows=[], by_row=False, num_rows=2)
    assert readback.wait(pending) == [None, None]


def test_ids_by_batch_row_skip_the_padding_rows():
    readback = TokenReadback(torch.device("cpu"))
    pending = readback.start(torch.tensor([5, 6, 0, 0]), rows=[0, 1], by_row=True, num_rows=2)
    assert readback.wait(pending) == [5, 6]


def test_ids_are_copied_when_started_so_a_later_step_may_overwrite_the_device_buffer():
    readback = TokenReadback(torch.device("cpu"))
    buffer = torch.tensor([7, 8])
    pending = readback.start(buffer, rows=[0, 1], by_row=True, num_rows=2)
    buffer.fill_(-1)
    assert readback.wait(pending) == [7, 8]
