"""The dispatcher in tpfuse.kernels: one Triton twin per reference, chosen by device or TPFUSE_KERNELS."""

import pytest
import torch

import tpfuse.kernels as kernels
from tpfuse import knobs
from tpfuse.kernels import (
    activation,
    decode_attention,
    kv_store,
    prefill_attention,
    qk_norm_rope_store_kv,
    rmsnorm,
    rope,
    rope_decode_attention,
    rope_store_kv,
    sampling,
)

OPS = [
    (rmsnorm, "rmsnorm"),
    (rmsnorm, "fused_add_rmsnorm"),
    (rope, "rope"),
    (rope_store_kv, "rope_store_kv"),
    (qk_norm_rope_store_kv, "qk_norm_rope_store_kv"),
    (activation, "silu_and_mul"),
    (kv_store, "store_kv"),
    (decode_attention, "decode_attention"),
    (rope_decode_attention, "rope_decode_attention"),
    (prefill_attention, "prefill_attention"),
    (sampling, "sample"),
]


@pytest.mark.parametrize("module,name", OPS, ids=[name for _, name in OPS])
def test_every_reference_has_a_triton_twin_with_the_same_parameters(module, name):
    import inspect

    ref, triton_impl = getattr(module, f"{name}_ref"), getattr(module, f"{name}_triton")
    assert list(inspect.signature(ref).parameters) == list(inspect.signature(triton_impl).parameters)


@pytest.mark.parametrize("mode,expected", [("torch", "_ref"), ("triton", "_triton"), ("auto", "_ref")])
def test_cpu_tensors_take_the_reference_unless_triton_is_forced(monkeypatch, mode, expected):
    monkeypatch.setenv("TPFUSE_KERNELS", mode)
    knobs.reload()
    picked = kernels._pick(rmsnorm, "rmsnorm", torch.zeros(1))
    assert picked is getattr(rmsnorm, f"rmsnorm{expected}")


def test_forced_triton_runs_through_the_public_op(monkeypatch):
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")
    knobs.reload()
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    out = kernels.silu_and_mul(x)
    torch.testing.assert_close(out, activation.silu_and_mul_ref(x))
