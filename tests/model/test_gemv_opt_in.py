"""TPFUSE_GEMV=triton sends decode-sized projections through tpfuse's Triton GEMV; the result must be
the same linear map (bias included) as F.linear, and larger batches must keep the cuBLAS path."""

import torch
import torch.nn.functional as F

from tpfuse.model import layers


def _opt_in(monkeypatch):
    monkeypatch.setattr(layers, "GEMV_OPT_IN", True)
    monkeypatch.setenv("TPFUSE_GEMV", "triton")
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")  # Triton (interpreted on CPU) for CPU tensors too


def test_opted_in_small_batch_linear_equals_f_linear_with_bias(monkeypatch):
    _opt_in(monkeypatch)
    calls = []
    real = layers.linear_small_batch
    monkeypatch.setattr(layers, "linear_small_batch", lambda x, w: calls.append(x.shape) or real(x, w))
    x = torch.randn(3, 40).half()
    weight, bias = torch.randn(37, 40).half(), torch.randn(37).half()
    out = layers._linear(x, weight, bias)
    expected = (x.double() @ weight.double().T + bias.double()).half()
    assert calls == [(3, 40)]
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)


def test_batches_above_the_gemv_limit_keep_f_linear(monkeypatch):
    _opt_in(monkeypatch)
    monkeypatch.setattr(layers, "linear_small_batch", lambda x, w: (_ for _ in ()).throw(AssertionError))
    x = torch.randn(layers.GEMV_MAX_ROWS + 1, 40).half()
    weight = torch.randn(37, 40).half()
    assert torch.equal(layers._linear(x, weight), F.linear(x, weight))


def test_without_the_opt_in_the_layers_use_f_linear(monkeypatch):
    monkeypatch.setattr(layers, "GEMV_OPT_IN", False)
    monkeypatch.setattr(layers, "linear_small_batch", lambda x, w: (_ for _ in ()).throw(AssertionError))
    x, weight = torch.randn(2, 40), torch.randn(37, 40)
    assert torch.equal(layers._linear(x, weight), F.linear(x, weight))
