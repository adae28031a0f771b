"""Programmatic dependent launch is probed, never assumed: where it cannot run, kernels launch plainly."""

import torch

from tpfuse.kernels.pdl import launch_options, pdl_status


def test_a_cpu_device_gets_plain_launches_and_the_reason():
    on, why = pdl_status(torch.device("cpu"))
    assert not on
    assert "not a CUDA device" in why
    assert launch_options(torch.device("cpu")) == {"USE_PDL": False}


def test_tpfuse_pdl_0_turns_it_off_before_any_probe(monkeypatch):
    monkeypatch.setenv("TPFUSE_PDL", "0")
    on, why = pdl_status(torch.device("cuda", 0))  # no GPU needed: the setting is read first
    assert not on
    assert why == "turned off by TPFUSE_PDL=0"
    assert launch_options(torch.device("cuda", 0)) == {"USE_PDL": False}
