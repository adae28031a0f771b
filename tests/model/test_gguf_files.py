"""GGUF files written by the test (gguf's GGUFWriter): a Qwen3 with Q4_K, Q6_K, Q8_0, Q4_0, Q4_1, F16
and F32 tensors, merged projections of mixed types (dequantized at load) and of one group type (run
by the group-quantized kernels); tpfuse's logits equal transformers' loading the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model.harness import load_for_test, relative_error, run_prefill_then_decode

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = (
    256,
    512,
    4,
    2,
    128,
    2,
    300,
)  # head_dim: Qwen3 default
TYPES = {  # gguf tensor -> stored type
    "attn_q": "Q4_K",
    "attn_k": "Q6_K",
    "attn_v": "Q8_0",
    "attn_output": "Q4_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q4_1",
    "ffn_down": "F16",
}


def _k_quant_blocks(rng, rows: int, cols: int, kind: str) -> np.ndarray:
    """Random K-quant blocks (gguf cannot quantize to them) with small finite fp16 super-scales."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, (rows, cols // block_values, block_bytes), dtype=np.uint8)
    scale = (rng.random((rows, cols // block_values)) * 2e-3 + 1e-4).astype(np.float16).view(np.uint8)
    if kind == "Q4_K":  # d, dmin first
        blocks[..., 0:2] = scale.reshape(rows, -1, 2)
        blocks[..., 2:4] = scale.reshape(rows, -1, 2)
    else:  # Q6_K: d last
        blocks[..., -2:] = scale.reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


def write_qwen3_gguf(path: str) -> None:
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)

    def add(name, rows, cols, kind):
        values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        if kind in ("Q4_K", "Q6_K"):
            writer.add_tensor(
                name, _k_quant_blocks(rng, rows, cols, kind), raw_dtype=gguf.GGMLQuantizationType[kind]
            )
        elif kind == "F32":
            writer.add_tensor(name, values)
        elif kind == "F16":
            writer.add_tensor(name, values.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", VOCAB, HIDDEN, "Q8_0")
    add("output.weight", VOCAB, HIDDEN, "F16")
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    shapes = {
        "attn_q": (HEADS * HEAD_DIM, HIDDEN),
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_output": (HIDDEN, HEADS * HEAD_DIM),
        "ffn_gate": (INTERMEDIATE, HIDDEN),
        "ffn_up": (INTERMEDIATE, HIDDEN),
        "ffn_down": (HIDDEN, INTERMEDIATE),
    }
    for i in range(LAYERS):
        for name, (rows, cols) in shapes.items():
            add(f"blk.{i}.{name}.weight", rows, cols, TYPES[name])
        for name, size in (
            ("attn_norm", HIDDEN),
            ("ffn_norm", HIDDEN),
            ("attn_q_norm", HEAD_DIM),
            ("attn_k_norm", HEAD_DIM),
        ):
            writer.add_tensor(
                f"blk.{i}.{name}.weight", (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-qwen3.gguf")
    write_qwen3_gguf(path)
    return path


def test_mixed_type_qwen3_gguf_logits_equal_transformers_on_the_same_file(qwen3_gguf):
    import os

    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(qwen3_gguf)
    hf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    model, config = load_for_test(qwen3_gguf)
    assert (config.architecture, config.num_layers, config.head_dim) == ("Qwen3ForCausalLM", LAYERS, HEAD_DIM)
    gate_up, qkv = model.layers[0].mlp.gate_up_proj, model.layers[0].self_attn.qkv_proj
    assert gate_up.method.kind == "Q4_1" and model.layers[0].self_attn.o_proj.method.kind == "Q4_0"
    assert qkv.method.kind is None and model.layers[0].mlp.down_proj.method.kind is None  # dequantized
    prompts = [[5, 17, 99, 3, 250, 42], [7, 1]]
    prefill, _ = run_prefill_then_decode(model, prompts, [])
    with torch.no_grad():
        expected = torch.cat([hf_model(torch.tensor([p])).logits[0] for p in prompts])
    assert relative_error(prefill, expected) <= 1e-4


def test_a_gguf_tensor_of_an_unsupported_type_is_named(tmp_path):
    import gguf

    from tpfuse.model.loader import CheckpointError

    path = str(tmp_path / "iq.gguf")
    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_block_count(1)
    blocks = np.zeros((4, 2 * 66), dtype=np.uint8)  # IQ2_XXS: 66 bytes per 256 values
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"tensor blk\.0\.attn_q\.weight is IQ2_XXS; tpfuse reads"):
        load_for_test(path)
