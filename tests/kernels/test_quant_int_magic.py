"""kernels/quant_int_magic.py (INT4 at one row on the tensor cores, codes as B + q half pairs) under
the interpreter against float64 products of the dequantized weights: odd N and K, groups of 16 to
128 and the whole K, with and without the register prefetch, symmetric codes and offsets, bf16 and
fp32 scales, bf16 and fp16 x, split-K, poisoned outputs; the fallback where the kernel does not fit;
its sm_90 K loop's instructions per weight (real compiler, no GPU); on the GPU in and out of CUDA
graphs."""

import importlib.util
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import triton.language as tl

from tpfuse.kernels import int_linear_op, quant_int, quant_int_magic
from tpfuse.kernels.quant_int import MagicTile
from tpfuse.model.linear_choice import QUANT_TILES


@pytest.fixture(autouse=True)
def _interpreter_bf16_dot(monkeypatch):
    """The interpreter multiplies bf16 dot operands as their raw uint16 bits; widened to float32
    here (exact: what the tensor cores compute, bf16 products accumulated in fp32)."""
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def widen(h):
            if h.dtype.scalar != tl.bfloat16:
                return h
            bits = h.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _weights(n, k, group, asymmetric, scale_dtype, gen):
    values = torch.randint(0, 16, (n, k), generator=gen)
    groups = -(-k // group)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).to(scale_dtype)
    offsets = torch.randn(n, groups, generator=gen) * 0.05 if asymmetric else None
    return quant_int.pack_int(values, 4), values, scales, offsets


def _float64(x, values, scales, offsets, group, bias):
    k = x.shape[1]
    s = scales.double().repeat_interleave(group, 1)[:, :k]
    if offsets is None:
        weight = (values.double() - 8) * s
    else:
        weight = values.double() * s + offsets.double().repeat_interleave(group, 1)[:, :k]
    out = x.double() @ weight.T
    return out if bias is None else out + bias.double()


def _poisoned_run(x, packed, scales, offsets, group, bias, tile, monkeypatch):
    """The kernel's output tensor is allocated full of NaN, so a column it skips shows."""
    empty = torch.empty

    def poisoned(*shape, **kw):
        return empty(*shape, **kw).fill_(float("nan"))

    monkeypatch.setattr(quant_int_magic.torch, "empty", poisoned)
    try:
        return quant_int.int_linear_triton(x, packed, scales, offsets, 4, group, bias, tile=tile)
    finally:
        monkeypatch.setattr(quant_int_magic.torch, "empty", empty)


@pytest.mark.parametrize(
    "n,k,group,asymmetric,scale_dtype,x_dtype,tile",
    [
        (37, 256, 128, False, torch.bfloat16, torch.bfloat16, MagicTile(1, 16, 128, 4, 4)),
        (45, 200, 48, True, torch.float32, torch.bfloat16, MagicTile(1, 32, 64, 2, 4)),
        (19, 384, 32, False, torch.float32, torch.float16, MagicTile(1, 16, 128, 1, 4, split_k=2)),
        (33, 196, 196, True, torch.bfloat16, torch.bfloat16, MagicTile(1, 16, 64, 1, 4, split_k=3)),
        (64, 512, 128, False, torch.bfloat16, torch.bfloat16, MagicTile(1, 32, 128, 1, 4, split_k=4)),
        (48, 512, 64, False, torch.bfloat16, torch.bfloat16, MagicTile(1, 16, 128, 3, 4, split_k=2)),
        (27, 208, 16, True, torch.float32, torch.bfloat16, MagicTile(1, 16, 64, 1, 4, split_k=2)),
    ],
)
def test_magic_int4_matches_float64_at_odd_shapes(
    n, k, group, asymmetric, scale_dtype, x_dtype, tile, monkeypatch
):
    gen = torch.Generator().manual_seed(n * 31 + k)
    packed, values, scales, offsets = _weights(n, k, group, asymmetric, scale_dtype, gen)
    x = torch.randn(1, k, generator=gen).to(x_dtype)
    bias = torch.randn(n, generator=gen).to(x_dtype) if asymmetric else None
    assert quant_int_magic.fits(x, 4, group)
    out = _poisoned_run(x, packed, scales, offsets, group, bias, tile, monkeypatch)
    expected = _float64(x, values, scales, offsets, group, bias)
    assert out.dtype == x_dtype and out.shape == (1, n) and torch.isfinite(out).all()
    # one rounding to x's dtype (a whole unit: the interpreter rounds toward zero), plus the fp32
    # sums of B + q minus B X
    tol = 2**-7 if x_dtype == torch.bfloat16 else 2**-10
    err = (out.double() - expected).abs()
    assert (err <= tol * expected.abs() + 1e-3 * expected.abs().max()).all(), err.max()


def test_the_tile_order_is_the_pair_order_of_the_packed_words(monkeypatch):
    """One weight row with a single nonzero code per position, x a one-hot: out picks exactly the
    code at k (the permutation of the tile columns and of x agree)."""
    gen = torch.Generator().manual_seed(5)
    k = 64
    values = torch.randint(0, 16, (16, k), generator=gen)
    packed = quant_int.pack_int(values, 4)
    scales = torch.ones(16, 1, dtype=torch.bfloat16)
    for col in (0, 3, 4, 7, 13, 60):
        x = torch.zeros(1, k, dtype=torch.bfloat16)
        x[0, col] = 1.0
        out = _poisoned_run(x, packed, scales, None, k, None, MagicTile(1, 16, 64, 1, 4), monkeypatch)
        assert torch.equal(out[0].float(), values[:, col].float() - 8), col


def test_shapes_the_kernel_does_not_fit_run_the_default_tile():
    """fp32 x, a group whose K step would be below the MMA's 16 (24: steps of 8), 8-bit codes, two
    rows."""
    gen = torch.Generator().manual_seed(6)
    packed, _, scales, _ = _weights(24, 96, 24, False, torch.bfloat16, gen)
    packed8 = quant_int.pack_int(torch.randint(0, 256, (24, 96), generator=gen), 8)
    scales32 = torch.rand(24, 3, generator=gen).bfloat16()
    x = torch.randn(2, 96, generator=gen)
    one = x[:1].bfloat16()
    cases = ((x[:1], packed, scales32, 4, 32), (one, packed, scales, 4, 24), (one, packed8, scales32, 8, 32),
             (x.bfloat16(), packed, scales32, 4, 32))  # fmt: skip
    for inp, codes, s, bits, group in cases:
        assert not quant_int_magic.fits(inp, bits, group)
        torch.testing.assert_close(
            quant_int.int_linear_triton(inp, codes, s, None, bits, group, tile=MagicTile(1, 16, 128)),
            quant_int.int_linear_triton(inp, codes, s, None, bits, group),
        )


def test_int_linear_op_sends_a_magic_tile_to_the_magic_kernel_and_start_up_times_it(monkeypatch):
    calls = []
    real = quant_int_magic.magic_int4_gemv
    monkeypatch.setattr(
        quant_int_magic, "magic_int4_gemv", lambda *a, **kw: calls.append(kw) or real(*a, **kw)
    )
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")
    from tpfuse import knobs

    knobs.reload()
    gen = torch.Generator().manual_seed(7)
    packed, values, scales, _ = _weights(16, 128, 128, False, torch.bfloat16, gen)
    x = torch.randn(1, 128, generator=gen).bfloat16()
    tile = MagicTile(1, 16, 128, 1, 4)
    out = int_linear_op(x, packed, scales, None, 4, 128, tile=tile)
    assert calls and calls[0]["tile"] == tile
    expected = _float64(x, values, scales, None, 128, None)
    torch.testing.assert_close(out.double(), expected, rtol=2**-7, atol=1e-3 * expected.abs().max().item())
    assert any(isinstance(t, MagicTile) for t in QUANT_TILES[1])


def test_magic_tiles_survive_the_tensor_parallel_broadcast():
    """Ranks agree on rank 0's tiles through pickled decisions (engine/tp_rank.rank0_decides)."""
    for tile in QUANT_TILES[1]:
        copy = pickle.loads(pickle.dumps(("int4 group 128", 1, tile, 3.0)))[2]
        assert copy == tile and type(copy) is type(tile) and copy.label() == tile.label()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tile", [t for t in QUANT_TILES[1] if isinstance(t, MagicTile)], ids=lambda t: t.label()
)
@pytest.mark.parametrize(
    "n,k,group,asymmetric",
    [(6144, 4096, 128, False), (4096, 14336, 128, False), (1000, 1536, 32, True), (4096, 4096, 4096, False)],
)
def test_magic_int4_matches_float64_in_and_out_of_cuda_graphs(n, k, group, asymmetric, tile):
    gen = torch.Generator("cuda").manual_seed(n + k)
    values = torch.randint(0, 16, (n, k), generator=gen, device="cuda")
    packed = quant_int.pack_int(values, 4)
    scales = (torch.rand(n, k // group, generator=gen, device="cuda") * 0.01 + 1e-3).to(torch.bfloat16)
    offsets = torch.randn(n, k // group, generator=gen, device="cuda") * 0.02 if asymmetric else None
    x = torch.randn(1, k, generator=gen, device="cuda").bfloat16()
    expected = _float64(x, values, scales, offsets, group, None)

    def run(inp):
        return quant_int.int_linear_triton(inp, packed, scales, offsets, 4, group, tile=tile)

    def close(out):
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
        assert (out.double() - expected).abs().max().item() <= 1e-2 * expected.abs().max().item()

    close(run(x))
    static = torch.zeros_like(x)
    run(static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(static)
    for _ in range(3):  # replays reuse the split-K counters: each leaves them at 0
        static.copy_(x)
        graph.replay()
    close(out)


def test_the_magic_k_loop_issues_fewer_instructions_per_weight_than_the_copy_bandwidth_allows():
    """The real sm_90 compiler (tests/kernels/quant_int_asm.py): every MagicTile candidate's K loop
    at K = 4096, group 128, bf16 x stays below 128 / 33 instructions per weight (what an SM issues
    against the INT4 weights 4.3 TB/s brings it) and below every FMA GEMV candidate's, without a
    stack."""
    script = Path(__file__).with_name("quant_int_asm.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = script.parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(script), "--json"], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    magic = [r for r in rows if r["kernel"] == "magic"]
    gemv = [r for r in rows if r["kernel"] == "gemv"]
    assert magic and gemv
    for row in magic:
        assert row["loop_instructions"] > 0 and row["mix"].get("HGMMA", 0) > 0, row
        assert row["per_weight"] < 128 / 33 and row["per_weight"] < min(r["per_weight"] for r in gemv), row
        assert row["stack"] == 0, row


def test_the_int4_gemv_benchmark_runs_and_its_kernels_agree_with_the_reference(tmp_path):
    """benchmarks/int4_gemv.py --smoke (tiny shapes on the CPU, one call per tile, no timing)."""
    spec = importlib.util.spec_from_file_location(
        "int4_gemv", Path(__file__).parents[2] / "benchmarks/int4_gemv.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--json", str(tmp_path / "rows.json")]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert {r["kernel"] for r in rows} == {"gemv", "magic", "half2", "ready"}  # ready: f16x2 on Half2X
    half2_tiles = sum(r["kernel"] == "half2" for r in rows)
    assert half2_tiles and sum(r["kernel"] == "ready" for r in rows) == half2_tiles
    assert len(rows) == len(bench.SMOKE_SHAPES) * len(QUANT_TILES[1]) + half2_tiles
    assert all(r["rel_err"] < 2**-7 for r in rows), rows
    producers = json.loads((tmp_path / "rows.json").read_text())["producers"]  # each with and without Half2X
    assert len(producers) == 4 and all(us > 0 for us in producers.values())
