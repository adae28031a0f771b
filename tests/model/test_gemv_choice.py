"""model/gemv_choice.py: one-row projections go to the Triton GEMV only for the weight shapes measured
faster (or forced with TPFUSE_GEMV); everything else stays on F.linear, and the model computes the same
map either way."""

import pytest
import torch
import torch.nn.functional as F

from tests.model.harness import load_for_test, run_prefill_then_decode
from tpfuse.model import gemv_choice, layers


@pytest.fixture(autouse=True)
def fresh_decisions():
    gemv_choice.reset()
    yield
    gemv_choice.reset()


def _weights():
    """Three weights of one shape (as 3 layers' o_proj) and one of another shape with a bias."""
    plain = [(torch.randn(37, 40).bfloat16(), None) for _ in range(3)]
    return plain + [(torch.randn(16, 37).bfloat16(), torch.randn(16).bfloat16())]


def test_auto_takes_the_gemv_only_where_it_needs_at_most_the_margin_of_cublas_time(monkeypatch):
    monkeypatch.delenv("TPFUSE_GEMV", raising=False)
    times = {(37, 40): {False: 10.0, True: 9.6}, (16, 37): {False: 10.0, True: 9.8}}  # 0.96 vs 0.98
    timed = []

    def fake_time_us(weights, use_gemv):
        shape = tuple(weights[0][0].shape)
        timed.append((shape, len(weights), use_gemv))
        return times[shape][use_gemv]

    decided = gemv_choice.choose(_weights(), time_us=fake_time_us)
    assert {(c.shape, c.gemv) for c in decided} == {((37, 40), True), ((16, 37), False)}
    # each shape timed both ways once, over all of its weights
    assert sorted(timed) == [
        ((16, 37), 1, False), ((16, 37), 1, True), ((37, 40), 3, False), ((37, 40), 3, True)
    ]  # fmt: skip
    assert "9.6 us vs cuBLAS 10.0 us" in decided[0].describe() + decided[1].describe()
    assert gemv_choice.choose(_weights(), time_us=fake_time_us) == []  # decided shapes are kept
    assert len(timed) == 4
    x = torch.randn(1, 40).bfloat16()
    assert gemv_choice.uses_gemv(x, torch.empty(37, 40).bfloat16(), None)
    assert not gemv_choice.uses_gemv(torch.randn(2, 40).bfloat16(), torch.empty(37, 40).bfloat16(), None)
    assert not gemv_choice.uses_gemv(x, torch.empty(37, 40).bfloat16(), torch.empty(37).bfloat16())


def test_auto_decides_nothing_on_cpu_and_float32_weights_are_never_candidates(monkeypatch):
    monkeypatch.delenv("TPFUSE_GEMV", raising=False)
    assert gemv_choice.choose(_weights()) == []  # CPU weights, no timer: F.linear throughout
    never = lambda *a, **k: pytest.fail("a float32 weight was timed")
    assert gemv_choice.choose([(torch.randn(8, 16), None)], time_us=never) == []


def test_an_unknown_tpfuse_gemv_value_names_the_choices(monkeypatch):
    monkeypatch.setenv("TPFUSE_GEMV", "fast")
    with pytest.raises(ValueError, match="TPFUSE_GEMV='fast' is not one of auto, triton, cublas"):
        gemv_choice.choose(_weights())


def test_forced_cublas_keeps_f_linear(monkeypatch):
    monkeypatch.setenv("TPFUSE_GEMV", "cublas")
    assert all(not c.gemv for c in gemv_choice.choose(_weights()))
    monkeypatch.setattr(layers, "gemv_op", lambda *a: pytest.fail("the GEMV ran"))
    x, weight = torch.randn(1, 40).bfloat16(), torch.randn(37, 40).bfloat16()
    assert torch.equal(layers._linear(x, weight), F.linear(x, weight))


def test_every_projection_of_a_one_row_decode_step_takes_the_chosen_gemv_and_logits_agree(monkeypatch):
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")  # Triton (interpreted on CPU) for CPU tensors too
    model, config = load_for_test("tiny", dtype="bfloat16")
    prompt, decode_tokens = [[5, 17, 3, 9]], [[11], [2]]
    _, plain = run_prefill_then_decode(model, prompt, decode_tokens)
    monkeypatch.setenv("TPFUSE_GEMV", "triton")
    projections = list(layers.projections(model))
    assert len(projections) == 4 * config.num_layers + 1  # qkv, o, gate_up, down per layer; lm_head
    assert all(c.gemv for c in gemv_choice.choose(projections))
    calls = []
    real = layers.gemv_op
    monkeypatch.setattr(layers, "gemv_op", lambda x, w, b: calls.append(x.shape) or real(x, w, b))
    _, with_gemv = run_prefill_then_decode(model, prompt, decode_tokens)
    # the 4-token prefill stays on F.linear; each one-row decode pass sends every projection
    assert len(calls) == 2 * len(projections) and all(rows == 1 for rows, _ in calls)
    for got, expected in zip(with_gemv, plain, strict=True):
        # bf16 activations: the two routes round each projection once, in different orders
        torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)
        assert got.argmax(-1).tolist() == expected.argmax(-1).tolist()


@pytest.mark.gpu
def test_on_the_gpu_the_measured_choice_is_the_faster_route_and_the_engine_makes_it(monkeypatch):
    from tpfuse import LLM, SamplingParams

    monkeypatch.delenv("TPFUSE_GEMV", raising=False)
    llm = LLM("tiny", device="cuda", dtype="bfloat16", max_model_len=256, mem_fraction_static=0.2)
    decisions = gemv_choice.decisions()
    assert decisions, "the engine made no one-row projection choice on the GPU"
    for choice in decisions:
        assert choice.cublas_us > 0 and choice.gemv_us > 0
        assert choice.gemv == (choice.gemv_us <= gemv_choice.MARGIN * choice.cublas_us)
    outputs = llm.generate(["hello"], SamplingParams(max_tokens=8, temperature=0.0))
    assert len(outputs[0].token_ids) == 8
