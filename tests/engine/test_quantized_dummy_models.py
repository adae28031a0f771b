"""`--load-format dummy --quantization int4 | fp8-block` on the CPU, for the dense tiny preset and a tiny
Qwen3-MoE config: every decoder linear and every layer's experts hold the quantized method (packed
INT4 words or FP8 e4m3 codes; lm_head and routers unquantized), `tpfuse generate` runs, and its greedy
tokens and prompt logits equal those of an unquantized model holding the same weights dequantized
(and differ from that model's own dummy weights, so the copy is what makes them equal)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from tests.engine.checkpoints import build_checkpoint
from tests.model.harness import PagedSequences, relative_error
from tpfuse.cli import main
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.kernels.quant_fp8 import FP8_DTYPE

PROMPTS = ["The quick brown fox", "hi", "abcabcabc abc"]
NEW_TOKENS = 8
CODES = {"int4": ("weight_packed", torch.int32), "fp8-block": ("weight", FP8_DTYPE)}
EXPERT_CODES = {"int4": ("w13_packed", torch.int32), "fp8-block": ("w13", FP8_DTYPE)}


@pytest.fixture(scope="module")
def moe_config_dir(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE directory (config.json and a tokenizer; its weights go unused with dummy)."""
    directory = str(tmp_path_factory.mktemp("qwen3_moe_dummy"))
    build_checkpoint(directory, "qwen3_moe")
    return directory


def _model(llm: LLM):
    return llm.engine.executor.runner.model


def _cli_tokens(model: str, quantization: str) -> list[list[int]]:
    argv = ["generate", "--model", model, "--load-format", "dummy", "--quantization", quantization]
    argv += ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64", "--json", "--ignore-eos"]
    argv += ["--max-tokens", str(NEW_TOKENS)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(argv) == 0
    return [json.loads(line)["token_ids"] for line in stdout.getvalue().splitlines()]


def _prompt_logits(model, prompt_ids: list[list[int]]) -> torch.Tensor:
    return PagedSequences(model, len(prompt_ids)).step(prompt_ids)[0]


def _copy_dequantized(quantized, plain) -> tuple[int, int]:
    """Copies each quantized linear's and experts' dequantized weights (kept by the reference path
    once it ran) into the unquantized model; returns (linears, expert layers) copied."""
    modules = dict(plain.named_modules())
    linears = experts = 0
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if "reference_weight" in module.__dict__:
                modules[name].weight.copy_(module.__dict__["reference_weight"])
                linears += 1
            if "reference_weights" in module.__dict__:
                w13, w2 = module.__dict__["reference_weights"]
                modules[name].w13.copy_(w13)
                modules[name].w2.copy_(w2)
                experts += 1
    return linears, experts


@pytest.mark.parametrize("quantization", ["int4", "fp8-block"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_dummy_quantized_model_generates_as_its_dequantized_weights(moe_config_dir, kind, quantization):
    model = "tiny" if kind == "dense" else moe_config_dir
    kw = dict(device="cpu", dtype="float32", load_format="dummy", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = LLM(model, quantization=quantization, **kw)
    tokens = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert all(len(t) == NEW_TOKENS for t in tokens)
    assert _cli_tokens(model, quantization) == tokens  # the flags reach the same model

    quantized = _model(llm)
    codes, dtype = CODES[quantization]
    num_layers = len(quantized.layers)
    sparse = [i for i, layer in enumerate(quantized.layers) if hasattr(layer.mlp, "experts")]
    assert (len(sparse) > 0) == (kind == "moe")
    for i, layer in enumerate(quantized.layers):
        linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
        if i in sparse:
            experts_codes, experts_dtype = EXPERT_CODES[quantization]
            assert getattr(layer.mlp.experts, experts_codes).dtype == experts_dtype
            assert layer.mlp.gate.weight.dtype == torch.float32  # the router stays unquantized
        else:
            linears += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
        for linear in linears:
            assert getattr(linear, codes).dtype == dtype, (i, linear)
    assert quantized.lm_head.weight.dtype == torch.float32

    plain_llm = LLM(model, **kw)
    prompt_ids = [llm.engine.tokenizer.encode(p) for p in PROMPTS]
    own_dummy = _prompt_logits(_model(plain_llm), prompt_ids)
    copied = _copy_dequantized(quantized, _model(plain_llm))
    assert copied == (4 * num_layers - 2 * len(sparse), len(sparse))
    assert [o.token_ids for o in plain_llm.generate(PROMPTS, params)] == tokens
    want = _prompt_logits(_model(plain_llm), prompt_ids)
    got = _prompt_logits(quantized, prompt_ids)
    assert relative_error(got, want) <= 1e-5
    assert relative_error(got, own_dummy) > 1e-3
