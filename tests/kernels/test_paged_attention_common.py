"""The shape-only split rule shared by the paged attention kernels (paged_attention_common.py)."""

import pytest
import torch

from tpfuse.kernels.paged_attention_common import choose_num_splits, num_splits_for


def test_split_count_depends_only_on_shapes_and_is_bounded_by_the_table_width():
    cpu = torch.device("cpu")
    assert choose_num_splits(1, 8, 1, 16, cpu) == 1
    assert choose_num_splits(256, 8, 512, 16, cpu) == 1
    assert 1 < choose_num_splits(1, 8, 512, 16, cpu) <= 32


@pytest.mark.parametrize(
    "batch,splits",
    [(1, 16), (8, 8), (64, 1), (128, 1)],
)
def test_split_rule_matches_the_best_split_counts_measured_on_an_h200(batch, splits):
    # llama-3.1-8b: 8 KV heads, block 16, block table wide enough for 8192 tokens; H200: 132 SMs
    assert num_splits_for(batch, 8, 512, 16, num_sms=132) == splits


def test_split_rule_never_splits_finer_than_one_key_tile_per_split():
    assert num_splits_for(1, 8, 8, 16, num_sms=132) == 2  # a 128-token table holds two 64-key tiles
