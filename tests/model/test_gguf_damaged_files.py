"""A truncated or damaged GGUF file fails with one error that names the file, says it is truncated or
damaged and asks for a re-download: wherever the cut falls (header, metadata such as the tokenizer's
arrays, tensor infos, tensor data) and whichever reader meets it first (the tokenizer's or the
model's)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.model.harness import load_for_test
from tpfuse.model.loader import CheckpointError
from tpfuse.model.tokenizer import load_tokenizer

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE = 64, 2, 1, 128
TOKENS = [b"<unk>", b"<s>", b"</s>"] + [bytes([c]) for c in range(ord("a"), ord("z") + 1)] + [b"ab"]


def write_llama_gguf(path: str, head_count: bool = True) -> None:
    """A one-layer Llama with a llama.cpp tokenizer in its metadata (F32 tensors)."""
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    if head_count:
        writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TOKENS)
    writer.add_token_scores([0.0] * len(TOKENS))
    writer.add_token_types([2, 3, 3] + [1] * (len(TOKENS) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    head_dim = HIDDEN // HEADS
    shapes = {
        "token_embd.weight": (len(TOKENS), HIDDEN),
        "blk.0.attn_q.weight": (HEADS * head_dim, HIDDEN),
        "blk.0.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
        "blk.0.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HEADS * head_dim),
        "blk.0.ffn_gate.weight": (INTERMEDIATE, HIDDEN),
        "blk.0.ffn_up.weight": (INTERMEDIATE, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, INTERMEDIATE),
    }
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        writer.add_tensor(name, np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory) -> tuple[bytes, dict[str, int]]:
    """The file's bytes and the offsets where each part of it lies."""
    import gguf

    path = str(tmp_path_factory.mktemp("gguf") / "good.gguf")
    write_llama_gguf(path)
    reader = gguf.GGUFReader(path)
    tensors = reader.tensors
    offsets = {
        "header": 10,  # inside the tensor and metadata counts
        "architecture": reader.fields["general.architecture"].offset + 12,
        "tokenizer tokens": reader.fields["tokenizer.ggml.tokens"].offset + 60,
        "tokenizer token types": reader.fields["tokenizer.ggml.token_type"].offset + 30,
        "tensor infos": reader.fields["tokenizer.ggml.eos_token_id"].offset + 40,
        "first tensor's data": reader.data_offset + 100,
        "middle tensor's data": int(tensors[len(tensors) // 2].data_offset) + 8,
        "last tensor's last bytes": int(tensors[-1].data_offset) + tensors[-1].n_bytes - 4,
    }
    with open(path, "rb") as f:
        return f.read(), offsets


def test_the_uncut_file_loads(good_gguf, tmp_path):
    path = tmp_path / "whole.gguf"
    path.write_bytes(good_gguf[0])
    assert load_tokenizer(str(path)).encode("ab")[-1] == TOKENS.index(b"ab")
    model, config = load_for_test(path)
    assert config.num_layers == 1 and config.vocab_size == len(TOKENS)


@pytest.mark.parametrize(
    "part",
    [
        "header",
        "architecture",
        "tokenizer tokens",
        "tokenizer token types",
        "tensor infos",
        "first tensor's data",
        "middle tensor's data",
        "last tensor's last bytes",
    ],
)
def test_a_cut_file_is_named_as_truncated_by_the_tokenizer_and_the_loader(good_gguf, tmp_path, part):
    data, offsets = good_gguf
    path = tmp_path / f"cut-in-{part.replace(' ', '-').replace(chr(39), '')}.gguf"
    path.write_bytes(data[: offsets[part]])
    message = rf"{re.escape(str(path))} is truncated or damaged \({offsets[part]} bytes; .*\); re-download it"
    with pytest.raises(ValueError, match=message):
        load_tokenizer(str(path))  # what the engine reads first
    with pytest.raises(CheckpointError, match=message):
        load_for_test(path)


def test_a_file_that_is_not_gguf_says_so(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"<html>404 Not Found</html>")
    with pytest.raises(CheckpointError, match=r"model\.gguf is not a GGUF file .*; re-download it"):
        load_for_test(path)


def test_missing_shape_metadata_is_named(tmp_path):
    path = tmp_path / "no-heads.gguf"
    write_llama_gguf(str(path), head_count=False)
    with pytest.raises(ValueError, match=r"no-heads\.gguf has no llama\.attention\.head_count metadata"):
        load_for_test(path)


@pytest.mark.parametrize(
    "field", ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "the metadata count"]
)
def test_a_corrupted_count_is_refused_before_the_gguf_package_parses_it(good_gguf, tmp_path, field):
    """A count far beyond the file's bytes (an array of 2^40 items) is named at once: the gguf package
    would build an object per claimed item until it ran off the end of the file."""
    import gguf

    data = bytearray(good_gguf[0])
    path = tmp_path / "corrupted.gguf"
    if field == "the metadata count":
        count_at = 16  # magic, version, tensor count
    else:
        path.write_bytes(data)
        offset = gguf.GGUFReader(str(path)).fields[field].offset
        count_at = offset + 8 + len(field) + 4 + 4  # key length, key, value type, item type
    data[count_at : count_at + 8] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(data)
    message = rf"{re.escape(str(path))} is truncated or damaged .*(claims|too many).*; re-download it"
    with pytest.raises(ValueError, match=message):
        load_tokenizer(str(path))
    with pytest.raises(CheckpointError, match=message):
        load_for_test(path)
