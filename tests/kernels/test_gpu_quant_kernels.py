"""Quantized linear kernels on the GPU against float64, eagerly and replayed in a CUDA graph, at
decode (1-64 rows) and prefill sizes; FP8 activation quantization bit-exact to its reference; the
FP8 tensor-core form where the probe finds FP8 tensor cores; quantized models end to end."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.quant_experts import random_expert_stack
from tpfuse.kernels import quant_fp8, quant_fp8_w8a8, quant_int

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
ROWS = (1, 3, 16, 33, 64, 200)


def _close(out, expected, tol=2e-2):
    assert torch.isfinite(out).all()
    scale = expected.abs().max().item() + 1e-6
    assert (out.double() - expected).abs().max().item() <= tol * scale


def _in_graph(fn, x):
    """fn(x) replayed from a CUDA graph after x's contents change (the decode graphs' contract)."""
    static = x.clone()
    fn(static)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static)
    static.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(
    "n,k,bits,group,asymmetric",
    [
        (4096, 4096, 4, 128, False),
        (1000, 1536, 4, 32, True),
        (576, 576, 8, 32, False),
        (6144, 4096, 4, 32, False),
    ],
)
def test_int_linear_matches_float64_in_and_out_of_cuda_graphs(rows, n, k, bits, group, asymmetric):
    gen = torch.Generator(DEVICE).manual_seed(rows + n)
    values = torch.randint(0, 2**bits, (n, k), generator=gen, device=DEVICE)
    packed = quant_int.pack_int(values, bits)
    scales = (torch.rand(n, k // group, generator=gen, device=DEVICE) * 0.01 + 1e-3).to(torch.bfloat16)
    offsets = torch.randn(n, k // group, generator=gen, device=DEVICE) * 0.02 if asymmetric else None
    x = torch.randn(rows, k, generator=gen, device=DEVICE).bfloat16()
    expected = x.double() @ quant_int.dequantize_int(packed, scales, offsets, bits, group, k).double().T

    def run(inp):
        return quant_int.int_linear_triton(inp, packed, scales, offsets, bits, group)

    _close(run(x), expected)
    _close(_in_graph(run, x), expected)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(
    "n,k,block",
    [(4096, 4096, (1, 4096)), (6144, 4096, (1, 128)), (1000, 1500, (1, 128)), (6144, 4096, (128, 128)),
     (1000, 1500, (128, 128))],
)  # fmt: skip
def test_fp8_linear_matches_float64_in_and_out_of_cuda_graphs(rows, n, k, block):
    gen = torch.Generator(DEVICE).manual_seed(rows + n)
    weight = torch.randn(n, k, generator=gen, device=DEVICE).to(quant_fp8.FP8_DTYPE)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen, device=DEVICE) * 0.01 + 1e-3
    x = torch.randn(rows, k, generator=gen, device=DEVICE).bfloat16()
    expected = x.double() @ quant_fp8.dequantize_fp8(weight, scale, block).double().T

    def run(inp):
        return quant_fp8.fp8_linear_triton(inp, weight, scale, block)

    _close(run(x), expected)
    _close(_in_graph(run, x), expected)


@pytest.mark.parametrize(
    "kind", ["int4 g128", "int4 g32 offsets", "fp8 channel", "fp8 block", "fp8 128x128 blocks"]
)
def test_every_timed_candidate_tile_matches_float64_in_and_out_of_cuda_graphs(kind, n=6144, k=4096):
    """Each tile start-up timing may choose (model/linear_choice.py) at each row bucket's extremes
    (FP8 blocks given per row, and as the checkpoint's 128 x 128 blocks a layer keeps)."""
    from tpfuse.model.linear_choice import QUANT_TILES

    gen = torch.Generator(DEVICE).manual_seed(n + k)
    if kind.startswith("fp8"):
        block = {"fp8 channel": (1, k), "fp8 block": (1, 128), "fp8 128x128 blocks": (128, 128)}[kind]
        weight = torch.randn(n, k, generator=gen, device=DEVICE).to(quant_fp8.FP8_DTYPE)
        scale = torch.rand(n // block[0], -(-k // block[1]), generator=gen, device=DEVICE) * 0.01 + 1e-3
        dequantized = quant_fp8.dequantize_fp8(weight, scale, block).double()
        tiles = quant_fp8.FP8_TILES

        def run(inp, tile):
            return quant_fp8.fp8_linear_triton(inp, weight, scale, block, tile=tile)
    else:
        bits, group = int(kind[3]), int(kind.split()[1][1:])
        values = torch.randint(0, 2**bits, (n, k), generator=gen, device=DEVICE)
        packed = quant_int.pack_int(values, bits)
        scales = (torch.rand(n, k // group, generator=gen, device=DEVICE) * 0.01 + 1e-3).to(torch.bfloat16)
        offsets = None
        if "offsets" in kind:
            offsets = torch.randn(n, k // group, generator=gen, device=DEVICE) * 0.02
        dequantized = quant_int.dequantize_int(packed, scales, offsets, bits, group, k).double()
        tiles = QUANT_TILES

        def run(inp, tile):
            return quant_int.int_linear_triton(inp, packed, scales, offsets, bits, group, tile=tile)

    for bucket, candidates in tiles.items():
        for rows in sorted({bucket, max(1, bucket // 2 + 1)}):
            x = torch.randn(rows, k, generator=gen, device=DEVICE).bfloat16()
            expected = x.double() @ dequantized.T
            for tile in candidates:
                _close(run(x, tile), expected)
                _close(_in_graph(lambda inp, tile=tile: run(inp, tile), x), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "n,k,group,offsets", [(4096, 4096, 128, False), (37, 1056, 32, True), (300, 14336, 14336, False)]
)
def test_half2_int4_gemv_matches_float64_at_hard_inputs(dtype, n, k, group, offsets):
    """The f16x2 PTX of kernels/quant_int_half2.py (the CPU tests run its fp32 stand-in): x with a few
    entries near 4000 and the rest near 1e-3 (the f16 sums' range), then only the 1e-3 ones (the
    precision of small x, which a fixed f16 scale would lose to subnormals), offsets,
    rows and whole vectors masked, into poisoned outputs, eagerly and in a CUDA graph."""
    from tpfuse.kernels import quant_int_half2
    from tpfuse.kernels.quant_int_half2 import Half2Tile

    gen = torch.Generator(DEVICE).manual_seed(n + k)
    packed = quant_int.pack_int(torch.randint(0, 16, (n, k), generator=gen, device=DEVICE), 4)
    scales = (torch.rand(n, -(-k // group), generator=gen, device=DEVICE) * 0.01 + 1e-3).bfloat16()
    shift = torch.randn(n, -(-k // group), generator=gen, device=DEVICE) * 0.02 if offsets else None
    tiny = torch.randn(1, k, generator=gen, device=DEVICE) * 1e-3
    spiked = tiny.clone()
    spiked[0, torch.randperm(k, generator=gen, device=DEVICE)[:8]] = 4000.0
    for x in (spiked.to(dtype), tiny.to(dtype)):
        expected = x.double() @ quant_int.dequantize_int(packed, scales, shift, 4, group, k).double().T
        tiles = (Half2Tile(1, 8, 1024, 1, 1), Half2Tile(1, 4, 2048, 1, 1), Half2Tile(1, 8, 4096, 1, 4),
                 Half2Tile(1, 2, 1024, 1, 1, split_k=3))  # fmt: skip
        for tile in tiles:
            out = torch.full((1, n), float("nan"), dtype=dtype, device=DEVICE)

            def run(inp, tile=tile, out=out):
                return quant_int_half2.half2_int4_gemv(inp, packed, scales, shift, group, tile=tile, out=out)

            _close(run(x), expected)
            _close(_in_graph(run, x), expected)


@pytest.mark.parametrize(
    "n,k,group,offsets", [(4096, 4096, 128, False), (37, 1056, 32, True), (6144, 4096, 128, False)]
)
def test_half2_int4_gemv_on_x_made_once_gives_the_plain_kernels_bits(n, k, group, offsets):
    """x converted once (quant_int_half2.half2_x, in torch) gives the operands the kernel makes in
    registers, so the product on it has the plain kernel's bits, eagerly and in a CUDA graph."""
    from tpfuse.kernels import quant_int_half2
    from tpfuse.kernels.quant_int_half2 import Half2Tile

    gen = torch.Generator(DEVICE).manual_seed(n * 3 + k)
    packed = quant_int.pack_int(torch.randint(0, 16, (n, k), generator=gen, device=DEVICE), 4)
    scales = (torch.rand(n, -(-k // group), generator=gen, device=DEVICE) * 0.01 + 1e-3).bfloat16()
    shift = torch.randn(n, -(-k // group), generator=gen, device=DEVICE) * 0.02 if offsets else None
    x = torch.randn(1, k, generator=gen, device=DEVICE).bfloat16()
    x[0, :5] = 3000.0
    made = quant_int_half2.half2_x(x)
    tiles = (Half2Tile(1, 4, 2048, 1, 1), Half2Tile(1, 2, 4096, 1, 1), Half2Tile(1, 4, 4096, 1, 2),
             Half2Tile(1, 2, 2048, 1, 1, split_k=2))  # fmt: skip
    for tile in tiles:
        plain = quant_int_half2.half2_int4_gemv(x, packed, scales, shift, group, tile=tile)
        out = torch.full((1, n), float("nan"), dtype=x.dtype, device=DEVICE)

        def run(_, tile=tile, out=out):
            return quant_int_half2.half2_int4_gemv(made, packed, scales, shift, group, tile=tile, out=out)

        assert torch.equal(run(None), plain)
        assert torch.equal(_in_graph(run, x), plain)


def test_fp8_activation_quantization_is_bit_exact_to_its_reference():
    x = torch.randn(77, 1000, device=DEVICE).bfloat16() * 3
    for group in (128, 1000):
        xq, xs = quant_fp8_w8a8.quantize_fp8_rows_triton(x, group)
        xq_ref, xs_ref = quant_fp8_w8a8.quantize_fp8_rows_ref(x, group)
        assert torch.equal(xs, xs_ref)
        assert torch.equal(xq.float(), xq_ref.float())


@pytest.mark.parametrize("hidden,block", [(4096, (1, 4096)), (1000, (1, 1000)), (4096, (128, 128))])
def test_fp8_rows_from_the_fused_norm_feed_the_w8a8_product_the_bits_of_its_own_quantization(hidden, block):
    """The fused add + RMSNorm writing FP8 rows (kernels/fp8_rows.py; a scale a row for per-channel
    weights, a 128-column group for 128 x 128 blocks) gives the bits of the plain kernel followed by
    quantize_fp8_rows, and the product on those rows the bits of fp8_w8a8_triton on the plain rows,
    eagerly and replayed from a CUDA graph."""
    from tpfuse.kernels.rmsnorm import fused_add_rmsnorm_fp8_rows_triton, fused_add_rmsnorm_triton

    gen = torch.Generator(DEVICE).manual_seed(hidden)
    x = (torch.randn(300, hidden, generator=gen, device=DEVICE) * 3).bfloat16()
    residual = torch.randn(300, hidden, generator=gen, device=DEVICE).bfloat16()
    norm_weight = (torch.rand(hidden, generator=gen, device=DEVICE) + 0.5).bfloat16()
    x[7] = 0
    residual[7] = 0
    group = quant_fp8_w8a8.activation_group(block, hidden)
    rows, new_residual = fused_add_rmsnorm_fp8_rows_triton(x, residual, norm_weight, 1e-5, group)
    normed, plain_residual = fused_add_rmsnorm_triton(x, residual, norm_weight, 1e-5)
    data, scales = quant_fp8_w8a8.quantize_fp8_rows_triton(normed, group)
    assert torch.equal(new_residual, plain_residual) and torch.equal(rows.scales, scales)
    assert torch.equal(rows.data.view(torch.uint8), data.view(torch.uint8))
    if not quant_fp8_w8a8.fp8_dot_supported(torch.device(DEVICE, torch.cuda.current_device())):
        return
    weight = torch.randn(2048, hidden, generator=gen, device=DEVICE).to(quant_fp8.FP8_DTYPE)
    scale = torch.rand(2048 // block[0], -(-hidden // block[1]), generator=gen, device=DEVICE) * 0.01 + 1e-3
    own = quant_fp8_w8a8.fp8_w8a8_triton(normed, weight, scale, block)
    assert torch.equal(quant_fp8_w8a8.fp8_w8a8_rows_triton(rows, weight, scale, block), own)

    def in_graph(inp):
        rows = fused_add_rmsnorm_fp8_rows_triton(inp, residual, norm_weight, 1e-5, group)[0]
        return quant_fp8_w8a8.fp8_w8a8_rows_triton(rows, weight, scale, block)

    assert torch.equal(_in_graph(in_graph, x), own)


@pytest.mark.parametrize("n,k,block", [(4096, 4096, (1, 4096)), (6144, 4096, (1, 128))])
def test_fp8_tensor_core_product_matches_float64_of_the_quantized_activations(n, k, block):
    if not quant_fp8_w8a8.fp8_dot_supported(torch.device(DEVICE, torch.cuda.current_device())):
        pytest.skip("this GPU failed the FP8-dot probe (no FP8 tensor cores): the W8A16 form runs instead")
    gen = torch.Generator(DEVICE).manual_seed(n)
    weight = torch.randn(n, k, generator=gen, device=DEVICE).to(quant_fp8.FP8_DTYPE)
    scale = torch.rand(n, -(-k // block[1]), generator=gen, device=DEVICE) * 0.01 + 1e-3
    x = torch.randn(300, k, generator=gen, device=DEVICE).bfloat16()
    group = quant_fp8_w8a8.activation_group(block, k)
    xq, xs = quant_fp8_w8a8.quantize_fp8_rows_ref(x, group)
    x_dequantized = xq.double() * xs.double().repeat_interleave(group, 1)[:, :k]
    expected = x_dequantized @ quant_fp8.dequantize_fp8(weight, scale, block).double().T
    _close(quant_fp8_w8a8.fp8_w8a8_triton(x, weight, scale, block), expected)
    _close(_in_graph(lambda inp: quant_fp8_w8a8.fp8_w8a8_triton(inp, weight, scale, block), x), expected)


@pytest.mark.parametrize(
    "n,k,block", [(4096, 4096, (1, 4096)), (6144, 4096, (1, 128)), (2048, 1024, (128, 128))]
)
@pytest.mark.parametrize("rows,bias", [(17, False), (64, True), (300, False), (2049, False), (301, True)])
def test_scaled_mm_prefill_matches_float64_of_the_activations_or_is_not_offered(n, k, block, rows, bias):
    """torch._scaled_mm's FP8 route (kernels/fp8_scaled_mm.py) where its probe passes, eagerly and in a
    graph, at decode buckets and prefill sizes, off its 4-row padding; where it fails, start-up is
    not offered it."""
    from types import SimpleNamespace

    from tpfuse.kernels import fp8_scaled_mm
    from tpfuse.model.quant.fp8 import Fp8LinearMethod

    device = torch.device(DEVICE, torch.cuda.current_device())
    gen = torch.Generator(DEVICE).manual_seed(n + rows)
    weight = torch.randn(n, k, generator=gen, device=DEVICE).to(quant_fp8.FP8_DTYPE)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen, device=DEVICE) * 0.01 + 1e-3
    per_block = block[1] < k
    layer = SimpleNamespace(weight=weight, fp8_block=block)
    method = Fp8LinearMethod("block", (128, 128)) if per_block else Fp8LinearMethod("channel")
    offered = method.prefill_candidates(layer)
    if not fp8_scaled_mm.scaled_mm_supported(device, per_block):
        assert fp8_scaled_mm.SCALED_MM not in offered
        return
    assert fp8_scaled_mm.SCALED_MM in offered and fp8_scaled_mm.SCALED_MM in method.tile_candidates(64, layer)
    x = torch.randn(rows, k, generator=gen, device=DEVICE).bfloat16()
    b = torch.randn(n, generator=gen, device=DEVICE).bfloat16() if bias else None
    group = quant_fp8_w8a8.activation_group(block, k)
    xq, xs = quant_fp8_w8a8.quantize_fp8_rows_ref(x, group)
    expected = (xq.double() * xs.double().repeat_interleave(group, 1)[:, :k]) @ quant_fp8.dequantize_fp8(
        weight, scale, block
    ).double().T
    if bias:
        expected += b.double()

    def run(inp):
        return fp8_scaled_mm.fp8_scaled_mm(inp, weight, scale, block, b)

    out = run(x)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    _close(out, expected)
    _close(_in_graph(run, x), expected)


@pytest.mark.parametrize(
    "n,k,block",
    [(4096, 4096, (1, 4096)), (6144, 4096, (1, 128)), (1000, 1500, (1, 128)), (6144, 4096, (128, 128))],
)
def test_every_w8a8_decode_tile_matches_float64_of_its_activation_groups_in_graphs(n, k, block):
    """The W8A8 decode candidates (kernels/quant_fp8_w8a8.py) at each row bucket's extremes, against
    float64 of x quantized per row and step by the reference (tolerance: an e4m3 step of rounding on a
    few activations, where the kernel's x * (1 / scale) and the reference's x / scale round apart)."""
    from types import SimpleNamespace

    from tpfuse.model.quant.fp8 import Fp8LinearMethod

    gen = torch.Generator(DEVICE).manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen, device=DEVICE).to(quant_fp8.FP8_DTYPE)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen, device=DEVICE) * 0.01 + 1e-3
    dequantized = quant_fp8.dequantize_fp8(weight, scale, block).double()
    if not quant_fp8_w8a8.fp8_dot_supported(torch.device(DEVICE, torch.cuda.current_device())):
        # no FP8 tensor cores: start-up timing must not offer the W8A8 tiles here (W8A16 runs instead)
        layer = SimpleNamespace(weight=weight, fp8_block=block)
        for bucket in quant_fp8_w8a8.W8A8_TILES:
            candidates = Fp8LinearMethod("channel").tile_candidates(bucket, layer)
            assert not any(isinstance(t, quant_fp8_w8a8.W8A8Tile) for t in candidates)
        return
    for bucket, tiles in quant_fp8_w8a8.W8A8_TILES.items():
        for rows in sorted({bucket, max(1, bucket // 2 + 1)}):
            x = torch.randn(rows, k, generator=gen, device=DEVICE).bfloat16()
            for tile in tiles:
                group = quant_fp8_w8a8.decode_group(block, k, tile)
                xq, xs = quant_fp8_w8a8.quantize_fp8_rows_ref(x, group)
                expected = (xq.double() * xs.double().repeat_interleave(group, 1)[:, :k]) @ dequantized.T

                def run(inp, tile=tile):
                    return quant_fp8_w8a8.fp8_w8a8_decode_triton(inp, weight, scale, block, tile=tile)

                _close(run(x), expected)
                _close(_in_graph(run, x), expected)


@pytest.mark.parametrize("hidden", [4096, 14336, 2048])
def test_norm_and_silu_write_half2x_bits_eagerly_and_in_graphs(hidden):
    """The producers of model/input_forms.py's Half2XForm on the GPU: the fused add + RMSNorm and
    SiLU-and-mul write half2_x's operands of the rows they would write, bit for bit, eagerly and in a
    CUDA graph."""
    from tpfuse.kernels import activation, quant_int_half2, rmsnorm

    gen = torch.Generator(DEVICE).manual_seed(hidden)
    x, residual = (torch.randn(1, hidden, generator=gen, device=DEVICE).bfloat16() for _ in range(2))
    x[0, :3] = 2000.0
    weight = torch.rand(hidden, generator=gen, device=DEVICE).bfloat16()
    gate_up = (torch.randn(1, 2 * hidden, generator=gen, device=DEVICE) * 4).bfloat16()
    normed, _ = rmsnorm.fused_add_rmsnorm_triton(x, residual, weight, 1e-5)
    cases = (
        (lambda inp: rmsnorm.fused_add_rmsnorm_half2x_triton(inp, residual, weight, 1e-5)[0], x, normed),
        (activation.silu_and_mul_half2x_triton, gate_up, activation.silu_and_mul_triton(gate_up)),
    )
    for make, inp, plain in cases:
        expected = quant_int_half2.half2_x(plain)
        for made in (make(inp), _in_graph(make, inp)):
            assert torch.equal(made.pairs, expected.pairs) and torch.equal(made.inv_m, expected.inv_m)
            assert torch.allclose(made.sums, expected.sums, rtol=1e-5, atol=1e-5)


def test_half2x_from_the_producers_gives_the_decode_logits_of_the_plain_row():
    """An INT4 model (dummy llama-3.2-1b, group 128) whose qkv, gate_up and down take Half2X from the
    norms and SiLU-and-mul (the route start-up timing may choose, forced here) gives the decode logits
    of the same f16x2 tile on the plain row, bit for bit; start-up keeps the route on Half2X only where
    it was faster."""
    from tests.model.harness import decode_logits_on_half2x, load_for_test, relative_error
    from tpfuse.kernels.quant_int_half2 import Half2Tile
    from tpfuse.model import linear_choice

    model, _ = load_for_test("llama-3.2-1b", dtype="bfloat16", device=DEVICE, load_format="dummy",
                             quantization="int4")  # fmt: skip
    prompt, decode = list(range(1, 40)), [7, 11, 13, 17]
    for tile in (Half2Tile(1, 4, 2048, 1, 1), Half2Tile(1, 4, 4096, 1, 2)):
        plain = decode_logits_on_half2x(model, prompt, decode, tile, on_form=False)
        on_form = decode_logits_on_half2x(model, prompt, decode, tile, on_form=True)
        assert torch.equal(on_form, plain), (
            f"{tile.label()}: Half2X moved the logits by {relative_error(on_form, plain):.2e} of the largest"
        )
    decided = linear_choice.choose_quantized([model], max_rows=1, buckets=(1,))
    plain_us = {key: us for key, bucket, _, us in decided if bucket == 1}
    for key, bucket, tile, us in decided:
        if bucket == linear_choice.FormBucket(1):
            assert isinstance(tile, Half2Tile) and us < plain_us[key]
    linear_choice.reset()


def test_an_int4_engine_taking_half2x_under_cuda_graphs_gives_the_plain_rows_tokens():
    """One sequence (one row a decode step) through the engine under CUDA graphs with the INT4 layers on
    one f16x2 tile, qkv, gate_up and down taking Half2X from the norms and SiLU-and-mul or the plain
    row (both forced before start-up, which then leaves bucket 1 as set): the same greedy tokens."""
    from tests.model.harness import load_for_test
    from tpfuse.engine.llm import LLM
    from tpfuse.engine.sampling_params import SamplingParams
    from tpfuse.kernels.quant_int_half2 import Half2Tile
    from tpfuse.model import linear_choice
    from tpfuse.model.input_forms import HALF2X

    model, _ = load_for_test("llama-3.2-1b", dtype="bfloat16", device=DEVICE, load_format="dummy",
                             quantization="int4")  # fmt: skip
    layer0 = model.layers[0]
    readers = (layer0.self_attn.qkv_proj, layer0.mlp.gate_up_proj, layer0.mlp.down_proj)
    tile = Half2Tile(1, 2, 2048, 1, 1, split_k=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for on_form in (False, True):
        linear_choice.reset()
        for layer in (*readers, layer0.self_attn.o_proj):
            linear_choice.set_quant_tile(layer, 1, tile)
        for layer in readers if on_form else ():
            linear_choice.set_form_route(layer, 1, tile)
        llm = LLM("llama-3.2-1b", device="cuda", dtype="bfloat16", quantization="int4", num_kv_blocks=256)
        tokens[on_form] = llm.generate([[1, 2, 3, 4, 5]], params)[0].token_ids
        llm.shutdown()
        assert all(layer.method.input_form(layer, 1) is (HALF2X if on_form else None) for layer in readers)
    linear_choice.reset()
    assert len(tokens[True]) == 24 and tokens[True] == tokens[False]


@pytest.mark.parametrize("quantization", ["fp8", "fp8-block"])
def test_fp8_rows_from_the_norms_give_the_prefill_logits_of_the_projections_own_quantization(quantization):
    """An FP8 model (dummy llama-3.2-1b, per-channel or 128 x 128 blocks) whose qkv and gate_up take FP8
    rows (the route start-up timing may choose, forced here) gives the prefill logits of its own
    quantization, bit for bit on the GPU, and start-up keeps FP8 rows only where they were faster."""
    from tests.model.harness import load_for_test, prefill_logits_on_routes, relative_error
    from tpfuse.kernels.fp8_scaled_mm import FP8_ROWS
    from tpfuse.model import linear_choice

    model, _ = load_for_test("llama-3.2-1b", dtype="bfloat16", device=DEVICE, load_format="dummy",
                             quantization=quantization)  # fmt: skip
    layer0 = model.layers[0]
    fp8_dot = quant_fp8_w8a8.fp8_dot_supported(torch.device(DEVICE, torch.cuda.current_device()))
    gate_up = layer0.mlp.gate_up_proj
    _, rows_routes = gate_up.method.form_candidates(gate_up, linear_choice.PREFILL)
    assert bool(rows_routes) == fp8_dot  # W8A16 throughout without FP8 dots
    if not fp8_dot:
        return
    prompt = list(range(1, 301))  # past the decode buckets' 64 rows: the prefill routes
    own = prefill_logits_on_routes(model, prompt, None)
    assert torch.equal(prefill_logits_on_routes(model, prompt, None), own), (
        "the plain prefill is not reproducible"
    )
    on_rows = prefill_logits_on_routes(model, prompt, FP8_ROWS)
    assert torch.equal(on_rows, own), (
        f"FP8 rows moved the logits by {relative_error(on_rows, own):.2e} of the largest"
    )
    decided = linear_choice.choose_quantized([model], max_rows=1, buckets=(1,), prefill_rows=512)
    prefill = {key: us for key, bucket, _, us in decided if bucket == linear_choice.PREFILL}
    for key, bucket, route, us in decided:
        if bucket == linear_choice.FormBucket(linear_choice.PREFILL):
            assert route == FP8_ROWS and us < prefill[key]
    linear_choice.reset()


@pytest.mark.parametrize("quantization", ["fp8", "fp8-block", "int4"])
def test_quantized_dummy_models_generate_under_cuda_graphs(quantization):
    from tpfuse.engine.llm import LLM
    from tpfuse.engine.sampling_params import SamplingParams

    llm = LLM("llama-3.2-1b", device="cuda", dtype="bfloat16", quantization=quantization, num_kv_blocks=256)
    eager = LLM("llama-3.2-1b", device="cuda", dtype="bfloat16", quantization=quantization, num_kv_blocks=256,
                enforce_eager=True)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    graphs, plain = llm.generate(prompts, params), eager.generate(prompts, params)
    for a, b in zip(graphs, plain, strict=True):
        assert len(a.token_ids) == 16
        assert a.token_ids[:4] == b.token_ids[:4]  # bf16: graph and eager kernels agree on the first steps
    llm.shutdown()
    eager.shutdown()


def test_smollm2_gguf_answers_the_capital_of_france_in_bf16_on_the_gpu():
    from tests.model.smollm2_gguf import smollm2_gguf
    from tpfuse.engine.llm import LLM
    from tpfuse.engine.sampling_params import SamplingParams

    llm = LLM(smollm2_gguf(), device="cuda", dtype="bfloat16", num_kv_blocks=256)
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))
    llm.shutdown()
    assert "Paris" in out.text


# 0: FP8; None: per-channel; a third value: rows sharing scales in runs of it (FP8 128 x 128 blocks)
@pytest.mark.parametrize("bits,group,row_block", [(4, 128, 1), (4, 32, 1), (0, 128, 1), (0, None, 1),
                                                  (0, 128, 128)])  # fmt: skip
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_quantized_expert_slots_match_float64_in_and_out_of_cuda_graphs(bits, group, row_block, tokens):
    from tpfuse.kernels import quant_moe

    gen = torch.Generator(DEVICE).manual_seed(bits + tokens)
    experts, hidden, inter, top_k = 16, 2048, 768, 8
    w13 = random_expert_stack(gen, bits, experts, 2 * inter, hidden, group, row_block)
    w2 = random_expert_stack(gen, bits, experts, hidden, inter, group, row_block)
    x = torch.randn(tokens, hidden, generator=gen, device=DEVICE).bfloat16()
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen, device=DEVICE).int()
    weights = torch.rand(tokens, top_k, generator=gen, device=DEVICE)
    expected = quant_moe.slots_ref(
        x.double(), w13.dequantize().double(), w2.dequantize().double(), weights, ids
    )

    from tpfuse.kernels.quant_moe_grouped import GROUPED_TILES, grouped_slots_triton

    half2 = quant_moe.HALF2_SLOT_TILES if bits == 4 else ()
    for tile in (None, *half2, *GROUPED_TILES):  # None / Half2SlotTile: the per-slot routes

        def run(inp, tile=tile):
            if tile is None or isinstance(tile, quant_moe.Half2SlotTile):
                return quant_moe.quant_slots_triton(inp, w13, w2, weights, ids, tile=tile)
            return grouped_slots_triton(inp, w13, w2, weights, ids, tile)

        _close(run(x), expected.double(), tol=3e-2)
        _close(_in_graph(run, x), expected.double(), tol=3e-2)


@pytest.mark.parametrize("bits,group", [(4, 128), (0, 128), (0, None)])  # 0: FP8; None: per-channel
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_quantized_routed_slots_equal_topk_then_slots_in_and_out_of_cuda_graphs(bits, group, tokens):
    """The per-slot routes with the top-k inside the gate/up launch: the top-k kernel's ids, its weights
    within float32 rounding (each launch shape sums in its own order: an H100 run found them off by
    ulps), and quant_slots_triton's products bit for bit at the routing it made, eagerly and replayed
    from a CUDA graph."""
    from tpfuse.kernels import quant_moe
    from tpfuse.kernels.moe_routing import moe_topk_triton

    gen = torch.Generator(DEVICE).manual_seed(bits + tokens + 7)
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    w13 = random_expert_stack(gen, bits, experts, 2 * inter, hidden, group)
    w2 = random_expert_stack(gen, bits, experts, hidden, inter, group)
    x = torch.randn(tokens, hidden, generator=gen, device=DEVICE).bfloat16()
    logits = torch.randn(tokens, experts, generator=gen, device=DEVICE)
    weights, ids = moe_topk_triton(logits, top_k, True)
    for tile in (None, *(quant_moe.HALF2_SLOT_TILES if bits == 4 else ())):

        def routed(inp, tile=tile):
            return quant_moe.quant_routed_slots_triton(inp, w13, w2, logits, top_k, True, tile=tile)

        out, got_w, got_ids = routed(x)
        assert torch.equal(got_ids, ids), tile
        torch.testing.assert_close(got_w, weights, rtol=2e-6, atol=0)
        want = quant_moe.quant_slots_triton(x, w13, w2, got_w, got_ids, tile=tile)
        assert torch.equal(out, want), tile
        assert torch.equal(_in_graph(lambda inp: routed(inp)[0], x), want), tile


@pytest.mark.parametrize("quantization", ["int4", "fp8-block"])
def test_quantized_dummy_qwen3_moe_generates_under_cuda_graphs(quantization):
    from tpfuse.engine.llm import LLM
    from tpfuse.engine.sampling_params import SamplingParams

    llm = LLM("qwen3-30b-a3b", device="cuda", dtype="bfloat16", quantization=quantization, num_kv_blocks=256)
    [out] = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    llm.shutdown()
    assert len(out.token_ids) == 16


@pytest.mark.parametrize("group", [128, None])  # None: per-channel
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_w8a8_expert_slots_match_their_reference_in_and_out_of_cuda_graphs(group, tokens):
    """Every W8A8 slot tile (kernels/quant_moe_w8a8.py) and W8A8 grouped tile against w8a8_slots_ref
    (the same activation quantization in torch, products in float32) and within W8A8's rounding of the
    float64 product."""
    from types import SimpleNamespace

    from tpfuse.kernels import quant_moe, quant_moe_w8a8
    from tpfuse.model.quant.experts import Fp8Experts

    gen = torch.Generator(DEVICE).manual_seed(tokens + (group or 0))
    if not quant_fp8_w8a8.fp8_dot_supported(torch.device(DEVICE)):  # then start-up races W8A16 only
        codes = torch.zeros(2, 256, 128, device=DEVICE).to(quant_fp8.FP8_DTYPE)
        experts = SimpleNamespace(w13=codes, hidden_size=128)
        assert not any(isinstance(r, quant_moe_w8a8.W8A8SlotTile)
                       for r in Fp8Experts("channel", None).route_candidates(experts, 8))  # fmt: skip
        return
    experts, hidden, inter, top_k = 16, 2048, 768, 8

    def stack(n, k):
        g = group or k
        codes = torch.randn(experts, n, k, generator=gen, device=DEVICE).to(quant_fp8.FP8_DTYPE)
        scales = torch.rand(experts, n, k // g, generator=gen, device=DEVICE) * 0.01 + 1e-3
        return quant_moe.QuantExperts(codes, scales, 0, g, k)

    w13, w2 = stack(2 * inter, hidden), stack(hidden, inter)
    x = torch.randn(tokens, hidden, generator=gen, device=DEVICE).bfloat16()
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen, device=DEVICE).int()
    weights = torch.rand(tokens, top_k, generator=gen, device=DEVICE)
    reference = quant_moe_w8a8.w8a8_slots_ref(x, w13, w2, weights, ids).double()
    unquantized = quant_moe.slots_ref(
        x.double(), w13.dequantize().double(), w2.dequantize().double(), weights, ids
    )
    from tpfuse.kernels import quant_moe_grouped

    for tile in quant_moe_w8a8.SLOT_TILES + quant_moe_grouped.W8A8_GROUPED_TILES:

        def run(inp, tile=tile):
            if tile in quant_moe_grouped.W8A8_GROUPED_TILES:
                return quant_moe_grouped.grouped_slots_triton(inp, w13, w2, weights, ids, tile)
            return quant_moe_w8a8.w8a8_slots_triton(inp, w13, w2, weights, ids, tile)

        # The kernels and the reference sum h in different orders, so an activation at an e4m3 (or
        # bf16) rounding boundary may take the neighbouring code: a few such flips among 64 x 8 slots
        # put the output 1.2 % of its largest value off the reference on the H100.
        _close(run(x), reference, tol=3e-2)
        _close(_in_graph(run, x), reference, tol=3e-2)
        _close(run(x), unquantized.double(), tol=6e-2)
