"""Bad checkpoints fail with one error that names the culprit (file, tensor, value) and the fix."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.harness import build_hf_checkpoint, load_for_test
from tpfuse.model.loader import CheckpointError, check_all_parameters_written

DOWN_PROJ = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("good")
    build_hf_checkpoint(directory, "llama", tie_word_embeddings=False)
    return directory


def copy_checkpoint(src, dst, edit_tensors=None, edit_config=None):
    """Copies a single-file checkpoint, editing its tensor dict and config dict on the way."""
    tensors = load_file(src / "model.safetensors")
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_missing_config_json_names_the_path(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        load_for_test(tmp_path)


def test_unknown_model_name_lists_the_presets():
    with pytest.raises(ValueError, match=r"neither a local directory, a .gguf file nor a preset.*llama-3\.1"):
        load_for_test("no-such-model")


def test_no_weight_files_suggests_dummy_weights(good_checkpoint, tmp_path):
    (tmp_path / "config.json").write_text((good_checkpoint / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weight files in .*--load-format dummy"):
        load_for_test(tmp_path)


def test_load_format_dummy_needs_no_weight_files(good_checkpoint, tmp_path):
    (tmp_path / "config.json").write_text((good_checkpoint / "config.json").read_text())
    model, _ = load_for_test(tmp_path, load_format="dummy")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_missing_tensor_is_named_with_the_file_it_belongs_in(good_checkpoint, tmp_path):
    copy_checkpoint(good_checkpoint, tmp_path, edit_tensors=lambda t: t.pop(DOWN_PROJ))
    with pytest.raises(CheckpointError, match=rf"missing 1 tensor.*{DOWN_PROJ}.*model\.safetensors"):
        load_for_test(tmp_path)


def test_tensor_missing_from_the_shard_the_index_names_is_reported(tmp_path):
    build_hf_checkpoint(tmp_path, "qwen2", max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = tmp_path / index["weight_map"][DOWN_PROJ]
    tensors = load_file(shard)
    tensors.pop(DOWN_PROJ)
    tensors["filler"] = torch.zeros(1)  # an empty file cannot be saved; the index does not list it
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{shard.name} is missing tensor {DOWN_PROJ}"):
        load_for_test(tmp_path)


def test_shard_file_listed_in_the_index_but_absent_is_named(tmp_path):
    build_hf_checkpoint(tmp_path, "qwen2", max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = tmp_path / index["weight_map"][DOWN_PROJ]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name} is listed in model\.safetensors\.index\.json"):
        load_for_test(tmp_path)


def test_shape_mismatch_names_tensor_expected_and_found_shapes(good_checkpoint, tmp_path):
    def shrink(tensors):
        tensors[DOWN_PROJ] = tensors[DOWN_PROJ][:, :100].contiguous()

    copy_checkpoint(good_checkpoint, tmp_path, edit_tensors=shrink)
    with pytest.raises(
        CheckpointError, match=rf"{DOWN_PROJ} in .* has shape \[64, 100\] .* needs \[64, 128\]"
    ):
        load_for_test(tmp_path)


def test_unexpected_extra_tensors_are_reported(good_checkpoint, tmp_path):
    def add_layer(tensors):
        tensors["model.layers.2.mlp.down_proj.weight"] = torch.zeros(64, 128)

    copy_checkpoint(good_checkpoint, tmp_path, edit_tensors=add_layer)
    with pytest.raises(CheckpointError, match=r"no place for: model\.layers\.2\.mlp\.down_proj\.weight"):
        load_for_test(tmp_path)


def test_rotary_inv_freq_tensors_are_ignored(good_checkpoint, tmp_path):
    def add_inv_freq(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    copy_checkpoint(good_checkpoint, tmp_path, edit_tensors=add_inv_freq)
    model, _ = load_for_test(tmp_path)
    assert model.config.num_layers == 2


def test_quantized_stored_dtype_is_rejected_by_name(good_checkpoint, tmp_path):
    def quantize(tensors):
        tensors[DOWN_PROJ] = tensors[DOWN_PROJ].to(torch.int8)

    copy_checkpoint(good_checkpoint, tmp_path, edit_tensors=quantize)
    with pytest.raises(CheckpointError, match=rf"{DOWN_PROJ} in .* is stored as I8"):
        load_for_test(tmp_path)


def test_bfloat16_stored_weights_are_converted_to_the_run_dtype(good_checkpoint, tmp_path):
    def to_bf16(tensors):
        for name in tensors:
            tensors[name] = tensors[name].to(torch.bfloat16)

    copy_checkpoint(good_checkpoint, tmp_path, edit_tensors=to_bf16)
    model, _ = load_for_test(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")[DOWN_PROJ]
    assert model.layers[1].mlp.down_proj.weight.dtype == torch.float32
    assert torch.equal(model.layers[1].mlp.down_proj.weight, stored.float())


def test_unsupported_architecture_lists_the_supported_ones(good_checkpoint, tmp_path):
    def gpt2(config):
        config["architectures"] = ["GPT2LMHeadModel"]

    copy_checkpoint(good_checkpoint, tmp_path, edit_config=gpt2)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel is not supported; supported: LlamaForCausalLM"):
        load_for_test(tmp_path)


def test_unsupported_checkpoint_dtype_asks_for_dtype_flag(good_checkpoint, tmp_path):
    def fp8(config):
        config["dtype"] = "float8_e4m3fn"

    copy_checkpoint(good_checkpoint, tmp_path, edit_config=fp8)
    with pytest.raises(ValueError, match=r"dtype 'float8_e4m3fn'.*pass --dtype bfloat16"):
        load_for_test(tmp_path, dtype="auto")


def test_tp_size_not_dividing_heads_names_the_value(good_checkpoint):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by --tp-size 3"):
        load_for_test(good_checkpoint, tp_rank=0, tp_size=3)


def test_parameter_without_a_checkpoint_tensor_is_caught(good_checkpoint):
    model, _ = load_for_test(good_checkpoint)
    slots = model.checkpoint_slots()
    slots.pop("model.layers.0.self_attn.v_proj.weight")
    with pytest.raises(RuntimeError, match=r"layers\.0\.self_attn\.qkv_proj\.weight .* never be written"):
        check_all_parameters_written(model, slots)


def test_mistral_consolidated_file_beside_hf_weights_is_not_read(good_checkpoint, tmp_path):
    copy_checkpoint(good_checkpoint, tmp_path)
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, tmp_path / "consolidated.safetensors")
    model, _ = load_for_test(tmp_path)
    assert model.config.num_layers == 2


@pytest.mark.parametrize("keep", [20, 0.5])
def test_a_truncated_weight_file_is_named_with_the_fix(good_checkpoint, tmp_path, keep):
    (tmp_path / "config.json").write_text((good_checkpoint / "config.json").read_text())
    data = (good_checkpoint / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(
        data[: keep if isinstance(keep, int) else int(len(data) * keep)]
    )
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors could not be read as safetensors .*re-download it"
    ):
        load_for_test(tmp_path)


@pytest.mark.parametrize("where", ["/etc/passwd", "../elsewhere.safetensors", 5])
def test_an_index_that_points_outside_the_checkpoint_is_refused(tmp_path, where):
    build_hf_checkpoint(tmp_path, "qwen2", max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"][DOWN_PROJ] = where
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"places {DOWN_PROJ} in .* not a file name inside"):
        load_for_test(tmp_path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_weight_holding_nan_or_infinity_is_named(good_checkpoint, tmp_path, bad):
    def poison(tensors):
        tensors[DOWN_PROJ][3, 5] = bad

    copy_checkpoint(good_checkpoint, tmp_path, edit_tensors=poison)
    with pytest.raises(CheckpointError, match=r"weight .*down_proj.* holds NaN or infinite values"):
        load_for_test(tmp_path)
