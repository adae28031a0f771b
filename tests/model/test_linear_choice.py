"""model/linear_choice.py: projections go to the one-row GEMV or a few-row Triton tile only for the
(weight shape, row bucket) cases measured faster (or forced with TPFUSE_LINEAR); everything else
stays on F.linear, and the model computes the same map either way."""

import pytest
import torch
import torch.nn.functional as F

from tests.model.harness import PagedSequences, load_for_test
from tpfuse import knobs
from tpfuse.kernels.skinny_linear import Tile
from tpfuse.model import layers, linear_choice, linear_method
from tpfuse.model.linear_choice import GEMV, TILES


@pytest.fixture(autouse=True)
def fresh_decisions(monkeypatch):
    monkeypatch.delenv("TPFUSE_LINEAR", raising=False)
    knobs.reload()
    linear_choice.reset()
    yield
    linear_choice.reset()


def _weights():
    """Three weights of one shape (as 3 layers' o_proj) and one of another shape with a bias."""
    plain = [(torch.randn(37, 40).bfloat16(), None) for _ in range(3)]
    return plain + [(torch.randn(16, 37).bfloat16(), torch.randn(16).bfloat16())]


def test_row_buckets():
    assert [linear_choice.bucket(m) for m in (1, 2, 16, 17, 32, 33, 64, 65, 512)] == [
        1, 16, 16, 32, 32, 64, 64, None, None
    ]  # fmt: skip


def test_auto_takes_the_fastest_triton_route_only_where_it_needs_at_most_the_margin_of_cublas():
    second_tile = TILES[16][1]

    def fake_time_us(weights, rows, route):
        timed.append((tuple(weights[0][0].shape), len(weights), rows, route))
        if route is None:
            return 10.0
        if tuple(weights[0][0].shape) == (37, 40):  # GEMV 0.96 of cuBLAS; the second 16-row tile 0.9
            return 9.6 if route == GEMV else 9.0 if route == second_tile else 11.0
        return 9.85  # (16, 37): 0.985 of cuBLAS everywhere, not enough

    timed = []
    decided = linear_choice.choose(_weights(), max_rows=4, time_us=fake_time_us)
    routes = {(c.shape, c.bucket): c.route for c in decided}
    assert routes == {
        ((37, 40), 1): GEMV,
        ((37, 40), 16): second_tile,
        ((16, 37), 1): None,
        ((16, 37), 16): None,
    }
    # max_rows 4: buckets 1 and 16 only; each case timed once per route, over all of its weights
    assert sorted((shape, n, rows) for shape, n, rows, _ in timed if _ is None) == [
        ((16, 37), 1, 1), ((16, 37), 1, 16), ((37, 40), 3, 1), ((37, 40), 3, 16)
    ]  # fmt: skip
    assert len(timed) == 2 * (2 + 1 + len(TILES[16]))  # per shape: cuBLAS twice, the GEMV, the tiles
    assert "9.0 us vs cuBLAS 10.0 us" in " ".join(c.describe() for c in decided)
    assert linear_choice.choose(_weights(), max_rows=4, time_us=fake_time_us) == []  # decided: kept
    w = torch.empty(37, 40).bfloat16()
    assert linear_choice.route(torch.randn(1, 40).bfloat16(), w, None) == GEMV
    assert linear_choice.route(torch.randn(16, 40).bfloat16(), w, None) == second_tile
    assert linear_choice.route(torch.randn(17, 40).bfloat16(), w, None) is None  # bucket 32: not timed
    assert linear_choice.route(torch.randn(1, 40).bfloat16(), w, torch.empty(37).bfloat16()) is None
    assert linear_choice.route(torch.randn(2, 80).bfloat16()[:, ::2], w, None) is None  # strided K


def test_the_margin_variable_moves_the_threshold_and_a_bad_value_names_the_variable(monkeypatch):
    fake = lambda weights, rows, route: 10.0 if route is None else 9.8  # noqa: E731  0.98 of cuBLAS
    monkeypatch.setenv("TPFUSE_LINEAR_MARGIN", "0.99")
    knobs.reload()
    assert all(c.route is not None for c in linear_choice.choose(_weights(), max_rows=1, time_us=fake))
    linear_choice.reset()
    monkeypatch.setenv("TPFUSE_LINEAR_MARGIN", "0.97")
    knobs.reload()
    assert all(c.route is None for c in linear_choice.choose(_weights(), max_rows=1, time_us=fake))
    linear_choice.reset()
    for bad in ("fast", "0", "-1", "nan"):
        monkeypatch.setenv("TPFUSE_LINEAR_MARGIN", bad)
        knobs.reload()
        with pytest.raises(ValueError, match=f"TPFUSE_LINEAR_MARGIN='{bad}' must be a number"):
            linear_choice.choose(_weights(), max_rows=1, time_us=fake)


def test_auto_decides_nothing_on_cpu_and_float32_weights_are_never_candidates():
    assert linear_choice.choose(_weights(), max_rows=64) == []  # CPU weights, no timer: F.linear
    never = lambda *a, **k: pytest.fail("a float32 weight was timed")
    assert linear_choice.choose([(torch.randn(8, 16), None)], max_rows=64, time_us=never) == []


def test_an_unknown_tpfuse_linear_value_names_the_choices(monkeypatch):
    monkeypatch.setenv("TPFUSE_LINEAR", "fast")
    knobs.reload()
    with pytest.raises(ValueError, match="TPFUSE_LINEAR='fast' is not one of auto, triton, cublas"):
        linear_choice.choose(_weights())


def test_forced_cublas_keeps_f_linear(monkeypatch):
    monkeypatch.setenv("TPFUSE_LINEAR", "cublas")
    knobs.reload()
    assert all(c.route is None for c in linear_choice.choose(_weights(), max_rows=64))
    monkeypatch.setattr(linear_method, "gemv_op", lambda *a: pytest.fail("the GEMV ran"))
    monkeypatch.setattr(linear_method, "skinny_linear_op", lambda *a, **k: pytest.fail("a few-row tile ran"))
    weight = torch.randn(37, 40).bfloat16()
    for rows in (1, 4, 64):
        x = torch.randn(rows, 40).bfloat16()
        assert torch.equal(linear_method.linear(x, weight), F.linear(x, weight))


def test_forced_triton_takes_the_first_tile_of_every_bucket_up_to_max_rows(monkeypatch):
    monkeypatch.setenv("TPFUSE_LINEAR", "triton")
    knobs.reload()
    decided = linear_choice.choose(_weights()[:1], max_rows=20)
    assert [(c.bucket, c.route) for c in decided] == [(1, GEMV), (16, TILES[16][0]), (32, TILES[32][0])]
    assert all(isinstance(TILES[b][0], Tile) and TILES[b][0].split_k == 1 for b in (16, 32, 64))


def _three_passes(model):
    """Logits of a 4-token prefill, a one-row decode step, then a 3-token extension (as a verify of
    2 drafts) of one sequence."""
    seqs = PagedSequences(model, 1)
    return [seqs.step([[5, 17, 3, 9]])[0], seqs.step([[11]], is_decode=True)[0], seqs.step([[2, 7, 4]])[0]]


def test_every_projection_of_prefill_decode_and_verify_passes_takes_its_route_and_logits_agree(monkeypatch):
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")  # Triton (interpreted on CPU) for CPU tensors too
    knobs.reload()
    # fp16: under TRITON_INTERPRET=1 tl.dot gets bf16 operands wrong (tests/kernels/test_skinny_linear.py)
    model, config = load_for_test("tiny", dtype="float16")
    plain = _three_passes(model)
    monkeypatch.setenv("TPFUSE_LINEAR", "triton")
    knobs.reload()
    projections = list(layers.projections(model))
    assert len(projections) == 4 * config.num_layers + 1  # qkv, o, gate_up, down per layer; lm_head
    assert all(c.route is not None for c in linear_choice.choose(projections, max_rows=16))
    calls = []
    real_gemv, real_skinny = linear_method.gemv_op, linear_method.skinny_linear_op

    def gemv(x, w, b):
        calls.append(("gemv", x.shape[0]))
        return real_gemv(x, w, b)

    def skinny(x, w, b, tile):
        calls.append((tile.block_m, x.shape[0]))
        return real_skinny(x, w, b, tile=tile)

    monkeypatch.setattr(linear_method, "gemv_op", gemv)
    monkeypatch.setattr(linear_method, "skinny_linear_op", skinny)
    routed = _three_passes(model)
    n = len(projections)  # every projection of each pass, by its row count
    assert sorted(calls, key=str) == sorted([(16, 4)] * n + [("gemv", 1)] * n + [(16, 3)] * n, key=str)
    for got, expected in zip(routed, plain, strict=True):
        # half-precision activations: the routes round each projection once, in different orders
        torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)
        assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()


@pytest.mark.gpu
def test_on_the_gpu_the_measured_choice_is_the_faster_route_and_the_engine_makes_it():
    from tpfuse import LLM, SamplingParams

    llm = LLM("tiny", device="cuda", dtype="bfloat16", max_model_len=256, mem_fraction_static=0.2)
    decisions = linear_choice.decisions()
    assert decisions, "the engine made no projection route choice on the GPU"
    assert {c.bucket for c in decisions} >= {1, 16}
    for choice in decisions:
        assert choice.cublas_us > 0 and choice.triton_us > 0
        assert (choice.route is not None) == (choice.triton_us <= linear_choice.margin() * choice.cublas_us)
    outputs = llm.generate(["hello"], SamplingParams(max_tokens=8, temperature=0.0))
    assert len(outputs[0].token_ids) == 8


def test_the_engine_times_buckets_up_to_its_largest_graph_step_and_the_eagle3_head_is_routed(tmp_path):
    from tests.engine.spec_helpers import spec_config, write_eagle3_head
    from tpfuse.config import EngineConfig
    from tpfuse.engine.spec_worker import SpecWorker
    from tpfuse.engine.step_limits import max_step_rows

    assert max_step_rows(EngineConfig(model="tiny", cuda_graph_max_bs=8, max_running_requests=4)) == 4
    with_spec = EngineConfig(model="tiny", cuda_graph_max_bs=4, speculative=spec_config("ngram"))
    assert max_step_rows(with_spec) == 16  # 4 rows x (newest token + spec_config's 3 drafts)
    head_dir = write_eagle3_head(str(tmp_path))
    tree = spec_config("eagle3", head_dir, eagle_topk=2, num_draft_tokens=8)
    assert (
        max_step_rows(EngineConfig(model="tiny", cuda_graph_max_bs=2, speculative=tree)) == 16
    )  # 2 x 8 nodes
    config = EngineConfig(model="tiny", speculative=spec_config("eagle3", head_dir))
    model, model_config = load_for_test("tiny")
    parallel = layers.ParallelContext(0, 1, None)
    head = SpecWorker(config, model, model_config, parallel, "cpu").head
    routed = {tuple(w.shape) for w, _ in layers.projections(head)}
    h = model_config.hidden_size
    assert (head.config.draft_vocab_size, h) in routed and (h, 3 * h) in routed  # lm_head, fc
    assert len(list(layers.projections(head))) == 9  # fc, q, k, v, o, gate, up, down, lm_head


def test_a_quantized_tile_that_does_not_build_or_fit_is_left_out_of_the_timing():
    import triton

    from tpfuse.kernels.quant_int import IntTile

    tiles = [IntTile(16, 64, 128, 3, 4), IntTile(16, 32, 128, 3, 4), IntTile(16, 128, 128, 3, 8)]

    def time_us(tile):
        if tile.block_n == 128:  # the fastest on paper, but too much shared memory for this GPU
            raise triton.runtime.errors.OutOfResources(262144, 101376, "shared memory")
        return {64: 20.0, 32: 15.0}[tile.block_n]

    assert linear_choice.fastest(tiles, time_us, "w at 16 rows") == (tiles[1], 15.0)

    def nothing_fits(tile):
        raise triton.runtime.errors.OutOfResources(262144, 101376, "shared memory")

    with pytest.raises(RuntimeError, match="no candidate tile of w at 16 rows builds, fits and agrees"):
        linear_choice.fastest(tiles, nothing_fits, "w at 16 rows")


def test_a_quantized_tile_whose_product_disagrees_with_the_reference_is_left_out():
    from tpfuse.kernels.quant_int import IntTile

    reference = torch.randn(4, 64)
    tiles = [IntTile(16, 64, 128, 3, 4), IntTile(16, 32, 128, 3, 4)]
    products = {64: reference * 1.02, 32: reference * 448.0}  # a W8A8-like rounding; a lost scale

    def time_us(tile):
        linear_choice.check_agrees(products[tile.block_n], reference, tile.label())
        return {64: 20.0, 32: 15.0}[tile.block_n]

    assert linear_choice.fastest(tiles, time_us, "w at 16 rows") == (tiles[0], 20.0)
    with pytest.raises(linear_choice.DisagreesWithReference, match="off by"):
        linear_choice.check_agrees(torch.full((4, 64), float("nan")), reference, "nan")


def test_a_prefill_route_is_kept_per_method_and_shape_and_only_past_the_decode_buckets():
    from types import SimpleNamespace

    from tpfuse.kernels.fp8_scaled_mm import SCALED_MM

    method = SimpleNamespace(tile_key=lambda layer: ("fp8-block", tuple(layer.shape)))
    qkv, other_qkv, down = (SimpleNamespace(method=method, shape=s) for s in ((6, 4), (6, 4), (4, 12)))
    linear_choice.set_quant_tile(qkv, 2048, SCALED_MM)
    assert linear_choice.quant_tile(other_qkv, 65) is SCALED_MM  # every layer of that shape, any prefill size
    assert linear_choice.quant_tile(qkv, 64) is None  # decode buckets are their own decisions
    assert linear_choice.quant_tile(down, 2048) is None
    linear_choice.set_quant_tile(qkv, 100, None)
    assert linear_choice.quant_tile(qkv, 2048) is None


def test_fp8_weights_offer_no_prefill_route_to_race_without_fp8_tensor_cores():
    """On the CPU (and any GPU failing the FP8-dot probe) more than 64 rows run W8A16: nothing to time."""
    from types import SimpleNamespace

    from tpfuse.kernels.fp8_scaled_mm import scaled_mm_supported
    from tpfuse.kernels.quant_fp8 import FP8_DTYPE
    from tpfuse.model.quant.fp8 import Fp8LinearMethod

    layer = SimpleNamespace(weight=torch.zeros(256, 256, dtype=FP8_DTYPE), fp8_block=(1, 128))
    assert Fp8LinearMethod("block", (128, 128)).prefill_candidates(layer) == ()
    assert not scaled_mm_supported(torch.device("cpu"), True)


def test_a_cublas_route_torch_refuses_is_left_out_of_the_timing_not_fatal():
    from tpfuse.kernels.fp8_scaled_mm import SCALED_MM, TRITON_PREFILL, ScaledMmUnavailable

    def time_us(route):
        if route is SCALED_MM:
            raise ScaledMmUnavailable("torch._scaled_mm refused a 2048 x 4096 x 4096 product: not supported")
        return 90.0

    chosen = linear_choice.fastest((TRITON_PREFILL, SCALED_MM), time_us, "w at 2048 rows")
    assert chosen == (TRITON_PREFILL, 90.0)
