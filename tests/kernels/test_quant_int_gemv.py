"""The one-row INT GEMV forms of kernels/quant_int_gemv.py (GemvTile) under the interpreter against float64
products of the dequantized weights: each form at odd N and K (masked rows, whole-vector and per-value K
masks), 4 and 8 bits, symmetric and offset codes, bias, bf16 pairs / unaligned bf16 / fp16 / fp32 x,
several K steps and row groups, into outputs poisoned with NaN; groups the forms do not take run the
GEMV of kernels/quant_int.py."""

import pytest
import torch

from tpfuse.kernels import quant_int, quant_int_gemv
from tpfuse.kernels.quant_int_gemv import GemvTile

TILES = {
    "vec": GemvTile(1, 8, 4096, 1, 4, pin=True),
    "vec-steps": GemvTile(1, 8, 256, 1, 2),  # several K steps
    "vec-prefetch": GemvTile(1, 8, 256, 1, 2, prefetch=True),
    "xs": GemvTile(1, 8, 4096, 1, 4, form="xs", pin=True, programs_per_sm=1),  # 2+ row groups a program
    "xs-prefetch": GemvTile(1, 4, 4096, 1, 2, form="xs", prefetch=True, programs_per_sm=1),
}


def _case(n, k, bits, group, offsets, seed):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 2**bits, (n, k), generator=gen)
    groups = -(-k // group)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    shift = (torch.randn(n, groups, generator=gen) * 0.05) if offsets else None
    x = torch.randn(1, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    return quant_int.pack_int(values, bits), scales, shift, x, bias


def _expected(x, packed, scales, offsets, bits, group, bias):
    weight = quant_int.dequantize_int(packed, scales, offsets, bits, group, x.shape[1]).double()
    out = x.double() @ weight.T
    return out if bias is None else out + bias.double()


def _check(out, expected, dtype):
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert out.dtype == dtype and out.shape == expected.shape
    assert torch.isfinite(out).all(), "an output left unwritten (NaN poison)"
    err = (out.double() - expected).abs().max().item()
    assert err <= tol * (expected.abs().max().item() + 1e-6), err


def _x_as(x, kind):
    if kind == "bf16-unaligned":  # bf16 that cannot be read as int32 pairs
        buf = torch.empty(1, x.shape[1] + 1, dtype=torch.bfloat16)
        buf[:, 1:] = x
        return buf[:, 1:]
    return x.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[kind])


CASES = [  # n, k, bits, group, offsets, bias, x
    (37, 256, 4, 32, False, False, "bf16"),  # K one step, rows masked
    (37, 264, 4, 264, True, True, "bf16"),  # one group; K masked per value
    (24, 1056, 4, 96, False, True, "fp32"),  # K masked per whole vector (1056 = 33 x 32)
    (3, 2000, 4, 160, True, False, "fp16"),
    (1, 512, 8, 64, False, True, "bf16"),
    (19, 1000, 8, 40, True, False, "bf16"),  # groups of 40 split 16-value vectors: quant_int's GEMV
    (2, 999, 4, 999, False, True, "bf16"),  # odd K: bf16 read singly
    (16, 384, 4, 128, False, False, "bf16-unaligned"),
    (9, 640, 8, 16, True, True, "fp32"),
    (70, 256, 4, 64, True, True, "bf16"),  # "xs": 9 row groups of 8 on 5 programs (8 CPU "SMs")
]


@pytest.mark.parametrize("form", list(TILES))
@pytest.mark.parametrize("n,k,bits,group,offsets,with_bias,x_kind", CASES)
def test_gemv_forms_match_float64(form, n, k, bits, group, offsets, with_bias, x_kind):
    tile = TILES[form]
    packed, scales, shift, x, bias = _case(n, k, bits, group, offsets, seed=n * 31 + k + bits)
    x = _x_as(x, x_kind)
    bias = bias.to(x.dtype) if with_bias else None
    expected = _expected(x, packed, scales, shift, bits, group, bias)
    if not quant_int_gemv.fits(bits, group, k) or form == "vec":  # the dispatch (or its fallback)
        out = quant_int.int_linear_triton(x, packed, scales, shift, bits, group, bias, tile=tile)
        _check(out, expected, x.dtype)
    if quant_int_gemv.fits(bits, group, k):  # the form itself, into a poisoned output
        out = torch.full((1, n), float("nan"), dtype=x.dtype)
        assert quant_int_gemv.int_gemv(x, packed, scales, shift, bits, group, bias, tile=tile, out=out) is out
        _check(out, expected, x.dtype)


def test_fits_takes_groups_of_whole_vectors():
    assert quant_int_gemv.fits(4, 128, 4096) and quant_int_gemv.fits(4, 96, 4096)
    assert not quant_int_gemv.fits(4, 40, 4096) and not quant_int_gemv.fits(4, 16, 4096)
    assert quant_int_gemv.fits(4, 264, 264)  # one group
    assert quant_int_gemv.fits(8, 16, 4096) and not quant_int_gemv.fits(8, 40, 4096)


def test_k_mask_modes():
    assert quant_int_gemv.k_mask(4096, 4096, 4) == 0
    assert quant_int_gemv.k_mask(14336, 4096, 4) == 1  # 3.5 steps of whole vectors
    assert quant_int_gemv.k_mask(264, 512, 4) == 2


def test_xs_programs_share_the_row_groups_evenly():
    tile = GemvTile(1, 8, 4096, 1, 4, form="xs", programs_per_sm=4)
    cpu = torch.device("cpu")  # 8 SMs stand in: at most 32 programs
    assert quant_int_gemv.xs_programs(tile, 28672, cpu) == 32  # 3584 groups of 8 rows: 112 each
    assert quant_int_gemv.xs_programs(tile, 8 * 33, cpu) == 17  # 33 groups: 2 each (not 32 and one of 2)
    assert quant_int_gemv.xs_programs(tile, 20, cpu) == 3


def test_gemv_tile_refuses_an_unknown_form_a_pinned_prefetch_and_several_rows():
    with pytest.raises(ValueError, match="form 'magic'"):
        GemvTile(1, 8, 4096, 1, 4, form="magic")
    with pytest.raises(ValueError, match="pin and prefetch"):
        GemvTile(1, 8, 2048, 1, 2, prefetch=True, pin=True)
    packed, scales, _, x, _ = _case(8, 256, 4, 128, False, seed=1)
    with pytest.raises(ValueError, match="one row"):
        quant_int.int_linear_triton(torch.cat([x, x]), packed, scales, None, 4, 128, tile=TILES["vec"])


def test_gemv_tiles_have_distinct_labels():
    labels = [t.label() for t in TILES.values()]
    assert len(set(labels)) == len(labels)
    assert TILES["xs-prefetch"].label() == "gemv-xs n4 k4096 w2 prefetch p1"
    assert GemvTile(1, 8, 4096, 1, 4, pin=True, max_registers=128).label() == "gemv-vec n8 k4096 w4 r128 pin"
