"""The cost model: it reproduces its own documented tables (docs/PCIE.md), the published figures it
was checked against stay within the documented distance, and `tpfuse comm-model` prints it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tpfuse.cli import main
from tpfuse.comm.cost_model import TopologyModel, crossover_bytes, nccl_us, schedule_us
from tpfuse.comm.model_report import DEFAULT_ROWS, markdown_table, model_json
from tpfuse.comm.topologies import NAMED, load_topology

DOC = Path(__file__).resolve().parents[2] / "docs" / "PCIE.md"
BLOCK = re.compile(r"<!-- comm-model (\S+) hidden=(\d+)(?: rows=([\d,]+))? -->\n(.*?)\n<!-- end -->", re.S)


def test_the_model_reproduces_every_table_documented_in_pcie_md():
    blocks = BLOCK.findall(DOC.read_text())
    assert len(blocks) == 3
    for name, hidden, rows, table in blocks:
        rows = tuple(int(r) for r in rows.split(",")) if rows else DEFAULT_ROWS
        assert markdown_table(model_json(NAMED[name], rows, int(hidden))) == table, name


PUBLISHED_NCCL = [(1, 59.7, 0.01), (8, 61.6, 0.08), (32, 75.0, 0.08), (128, 123.2, 0.01), (512, 294.4, 0.01)]


@pytest.mark.parametrize(("rows", "published", "within"), PUBLISHED_NCCL)
def test_nccl_predictions_fall_within_the_documented_distance_of_the_published_figures(
    rows, published, within
):
    predicted = nccl_us(NAMED["rtx-pro-6000-8x-2socket"], rows * 6144 * 2)
    assert abs(predicted - published) <= within * published


def test_one_shot_two_shot_crossover_falls_in_the_published_window_and_collapse_moves_it_down():
    assert 32_000 <= crossover_bytes(NAMED["rtx-pro-6000-8x-2socket"], "one_shot", "two_shot") <= 48_000
    assert crossover_bytes(NAMED["rtx-pro-6000-8x-2socket-collapse"], "one_shot", "two_shot") < 16_000


def test_write_collapse_makes_the_one_stream_and_read_schedules_win_at_decode_sizes():
    collapsed = NAMED["rtx-pro-6000-8x-2socket-collapse"]
    times = {s: schedule_us(collapsed, s, 8 * 6144 * 2) for s in ("one_shot", "ordered_push", "pull")}
    assert times["ordered_push"] < times["one_shot"] / 3 and times["pull"] < times["one_shot"] / 3


def test_one_island_has_no_hierarchical_prediction():
    assert "hierarchical" not in model_json(NAMED["rtx-pro-6000-4x"])["rows"][0]


def test_a_topology_round_trips_through_json_and_loads_from_a_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(NAMED["rtx-pro-6000-8x-2socket"].to_json()))
    loaded = load_topology(str(path))
    assert isinstance(loaded, TopologyModel) and loaded == NAMED["rtx-pro-6000-8x-2socket"]
    with pytest.raises(ValueError, match="unknown topology 'nope'"):
        load_topology("nope")


def test_comm_model_json_for_each_named_topology(capsys):
    for name in ("rtx-pro-6000-8x-2socket", "rtx-pro-6000-4x", "h200-8x-nvlink"):
        assert main(["comm-model", "--topology", name, "--json", "--rows", "1,512"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["topology"]["name"] == name and [r["rows"] for r in report["rows"]] == [1, 512]
        assert set(report["crossover_bytes"]) == {"one_shot->two_shot", "one_shot->nccl"}


def test_comm_model_text_names_the_topology_and_says_it_is_a_model(capsys):
    assert main(["comm-model"]) == 0
    text = capsys.readouterr().out
    assert "rtx-pro-6000-8x-2socket" in text and "not a measurement" in text and "crossover" in text
    assert main(["comm-model", "--topology", "missing.json"]) == 2
