"""`tpfuse doctor` and `tpfuse comm-bench` on a machine without a GPU, and comm-bench's output rules."""

from __future__ import annotations

import json

import pytest
import torch

from tpfuse.cli import main
from tpfuse.comm.bench import METHODS, SHARED_WARNING, chosen_method, format_table


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_doctor_json_on_cpu_says_there_is_no_gpu_and_exits_zero(no_gpu, capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpus"] == [] and "no CUDA GPU" in report["message"]
    assert report["versions"]["torch"] == torch.__version__
    used = [p["path"] for p in report["paths"] if p["used"]]
    assert used == ["gloo (CPU)"]


def test_doctor_text_names_every_path_and_why(no_gpu, capsys):
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert "no CUDA GPU" in text and "NCCL" in text and "tpfuse custom kernels" in text


def test_comm_bench_without_a_gpu_exits_nonzero_with_a_clear_message(no_gpu, capsys):
    assert main(["comm-bench", "--virtual-ranks", "2"]) != 0
    assert "needs CUDA GPUs" in capsys.readouterr().err


def test_chosen_path_is_the_custom_kernel_only_where_it_beats_nccl_plus_norm():
    row = {"tpfuse_fused_one_shot": 6.0, "tpfuse_fused_two_shot": 9.0, "nccl+norm": 15.0}
    assert chosen_method(row) == "tpfuse_fused_one_shot"
    assert chosen_method({**row, "nccl+norm": 6.0}) == "nccl+norm"
    assert chosen_method({"tpfuse_fused_one_shot": None, "nccl+norm": None}) is None
    assert chosen_method({**row, "tpfuse_fused_pull": 4.0}) == "tpfuse_fused_pull"


def test_table_shows_the_shared_gpu_warning_first_and_one_column_per_method():
    row = {"tp": 2, "tokens": 1, "hidden": 4096, "bytes": 8192, **dict.fromkeys(METHODS), "chosen": None}
    row["tpfuse_fused_one_shot"] = 7.5
    env = {"gpu": "G", "gpus": 1, "layout": "virtual", "world_size": 2, "torch": "t", "triton": "r"}
    text = format_table({"environment": {**env, "warning": SHARED_WARNING}, "rows": [row]})
    lines = text.splitlines()
    assert SHARED_WARNING.upper() in lines[1]
    header = next(line for line in lines if "tokens" in line).split()
    assert header == ["tp", "tokens", "hidden", "bytes", *METHODS, "chosen"]
    assert "7.5" in lines[-1]


def test_doctor_tp_size_without_a_gpu_says_there_is_no_plan_and_keeps_the_report(no_gpu, capsys):
    assert main(["doctor", "--json", "--tp-size", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "no CUDA GPU" in report["plan"]["error"] and report["gpus"] == []
    assert main(["doctor", "--tp-size", "8"]) == 0
    assert "plan: no CUDA GPU" in capsys.readouterr().out


def test_doctor_text_shows_topology_islands_probe_and_the_plan_with_reasons():
    from tests.comm.test_islands_and_topology import _topology
    from tests.comm.test_link_decision import _links
    from tpfuse.comm.doctor import _format_plan, _format_topology
    from tpfuse.comm.host_topology import derive_islands
    from tpfuse.comm.plan import Bucket, Plan

    topology = _topology("two_sockets_8gpu")
    islands, reason = derive_islands(topology)
    report = {
        "topology": topology.to_json(),
        "islands": {"islands": [list(i) for i in islands], "reason": reason},
    }
    text = "\n".join(_format_topology(report))
    assert (
        "GPU 5: bus 00000000:9C:00.0  NUMA node 1" in text
        and "islands (one rank per GPU): 0,1,2,3;4,5,6,7" in text
    )
    plan = Plan("nccl", [Bucket("fused", 12288, 1, "ordered_push", {"ordered_push": 6.0, "fallback": 60.0},
                                "10.00x faster than fallback")])  # fmt: skip
    lines = _format_plan({
        "tp_size": 8, "hidden": 6144, "max_tokens": 1, "communicator": "CustomCommunicator",
        "describe": plan.describe(), "removed": {"one_shot": "writes to many peers at once, and collapse"},
        "probe_decision": {"findings": ["write collapse on rank 0: 8.0 GB/s"], "removed": {}, "kept": []},
        "probe": _links(fanout_write=8.0).to_json(),
    })  # fmt: skip
    text = "\n".join(lines)
    assert "plan for --tp-size 8" in text and "link probe: write collapse on rank 0" in text
    assert "peer write 55.0 GB/s" in text and "fan-out write 8.0 GB/s" in text
    assert "not a candidate: one_shot" in text and "ordered_push" in text and "10.00x faster" in text


@pytest.mark.parametrize(
    "argv",
    [["doctor", "--tp-size", "0"], ["doctor", "--hidden", "-1"], ["doctor", "--max-tokens", "-1"],
     ["doctor", "--tp-size", "2,4"], ["comm-model", "--hidden", "0"], ["comm-model", "--layers", "-1"]],
)  # fmt: skip
def test_sizes_below_one_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and "positive integer" in capsys.readouterr().err
