"""The GGUF load log names, per projection and type, the linears that run through the group-quantized
kernels and the tensors dequantized at load (layer indices folded, counted), on the mixed-type Qwen3
GGUF that tests/model/test_gguf_files.py writes; the log agrees with the methods the model holds."""

from __future__ import annotations

import logging
import re

import pytest

from tests.model.harness import load_for_test
from tests.model.test_gguf_files import LAYERS, write_qwen3_gguf

KERNELS = [  # same-type merges of Q4_0/Q4_1/Q8_0 parts keep their codes
    f"model.layers.*.self_attn.o_proj Q4_0 x{LAYERS}",
    f"model.layers.*.mlp.gate_proj Q4_1 x{LAYERS}",
    f"model.layers.*.mlp.up_proj Q4_1 x{LAYERS}",
]
DEQUANTIZED = [  # v_proj is Q8_0, but q/k/v merge into one linear of mixed types: dequantized
    "model.embed_tokens.weight Q8_0",
    "model.norm.weight F32",
    "lm_head.weight F16",
    f"model.layers.*.input_layernorm.weight F32 x{LAYERS}",
    f"model.layers.*.post_attention_layernorm.weight F32 x{LAYERS}",
    f"model.layers.*.self_attn.q_proj.weight Q4_K x{LAYERS}",
    f"model.layers.*.self_attn.k_proj.weight Q6_K x{LAYERS}",
    f"model.layers.*.self_attn.v_proj.weight Q8_0 x{LAYERS}",
    f"model.layers.*.self_attn.q_norm.weight F32 x{LAYERS}",
    f"model.layers.*.self_attn.k_norm.weight F32 x{LAYERS}",
    f"model.layers.*.mlp.down_proj.weight F16 x{LAYERS}",
]
LINE = re.compile(
    r"GGUF (?P<file>\S+): (?P<kept>\d+) linears run by the group-quantized kernels \((?P<kernels>.*)\); "
    r"(?P<dequantized>\d+) tensors dequantized at load \((?P<names>.*)\)$"
)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gguf_log") / "mixed-qwen3.gguf")
    write_qwen3_gguf(path)
    return path


def test_the_load_log_says_which_tensors_run_quantized_and_which_were_dequantized(gguf_path, caplog):
    with caplog.at_level(logging.INFO, logger="tpfuse"):
        model, _ = load_for_test(gguf_path)
    [line] = [r.getMessage() for r in caplog.records if LINE.match(r.getMessage())]
    found = LINE.match(line)
    assert found["file"] == "mixed-qwen3.gguf"
    assert found["kernels"].split(", ") == KERNELS
    assert sorted(found["names"].split(", ")) == sorted(DEQUANTIZED)
    assert int(found["kept"]) == 3 * LAYERS
    assert int(found["dequantized"]) == 3 + 8 * LAYERS
    for layer in model.layers:  # the log agrees with the methods the linears hold
        assert layer.self_attn.o_proj.method.kind == "Q4_0" and layer.mlp.gate_up_proj.method.kind == "Q4_1"
        assert layer.self_attn.qkv_proj.method.kind is None and layer.mlp.down_proj.method.kind is None


def test_layers_of_different_types_are_counted_apart():
    from tpfuse.model.loader import _per_layer

    entries = [f"model.layers.{i}.mlp.down_proj.weight {'Q6_K' if i % 3 else 'Q4_K'}" for i in range(7)]
    assert _per_layer(["model.norm.weight F32", *entries]) == (
        "model.norm.weight F32, model.layers.*.mlp.down_proj.weight Q4_K x3, "
        "model.layers.*.mlp.down_proj.weight Q6_K x4"
    )
