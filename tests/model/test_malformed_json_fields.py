"""JSON of the wrong type in a checkpoint's model.safetensors.index.json or config.json's
quantization_config (a list where an object is due, a string where a number or list is due) fails
with one error naming the file, the field and the type it must have, not an AttributeError or
TypeError from deep inside a parser."""

from __future__ import annotations

import copy
import json
import re

import pytest

from tests.model.harness import build_hf_checkpoint, load_for_test
from tests.model.quant_checkpoints import compressed_tensors_config

INT4 = compressed_tensors_config(
    {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}, "pack-quantized"
)
FP8_BLOCK = compressed_tensors_config(
    {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
    "float-quantized",
    {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
)
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
GROUP = ["config_groups", "group_0"]
FIELD = r"config\.json: quantization_config\."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sharded")
    build_hf_checkpoint(directory, "llama", max_shard_size="100KB")
    return directory


def _copy(src, dst, config_edit=None, index_text=None):
    for file in src.iterdir():
        (dst / file.name).symlink_to(file)
    if config_edit is not None:
        config = json.loads((src / "config.json").read_text())
        config_edit(config)
        (dst / "config.json").unlink()
        (dst / "config.json").write_text(json.dumps(config))
    if index_text is not None:
        (dst / "model.safetensors.index.json").unlink()
        (dst / "model.safetensors.index.json").write_text(index_text)
    return dst


@pytest.mark.parametrize(
    "index, message",
    [
        ({"weight_map": []}, r"weight_map must be an object \(tensor name -> shard file\), got a list"),
        ({"weight_map": "model-00001.safetensors"}, r"weight_map must be an object .*, got a string"),
        ({"metadata": {}}, r"weight_map must be an object .*, got null"),
        ([{"weight_map": {}}], r"must hold a JSON object, got a list"),
    ],
)
def test_an_index_of_the_wrong_type_names_the_file_and_the_field(checkpoint, tmp_path, index, message):
    _copy(checkpoint, tmp_path, index_text=json.dumps(index))
    path = re.escape(str(tmp_path / "model.safetensors.index.json"))
    with pytest.raises(
        ValueError, match=rf"{path}:? {message}; restore the (index|file) from the checkpoint"
    ):
        load_for_test(tmp_path)


def test_a_config_json_that_is_not_an_object_names_the_file(checkpoint, tmp_path):
    _copy(checkpoint, tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ValueError, match=r"config\.json must hold a JSON object, got a list"):
        load_for_test(tmp_path)


G0 = rf"{FIELD}config_groups\.group_0"
CASES = [  # (quantization_config, path of the field, its wrong value, the message)
    (FP8, ["quant_method"], ["fp8"], rf"{FIELD}quant_method must be a string, got a list"),
    (FP8, ["weight_block_size"], "128", rf"{FIELD}weight_block_size must be \[block_n, block_k\].*got '128'"),
    (FP8, ["weight_block_size"], [128, True], rf"{FIELD}weight_block_size must be \[block_n, block_k\]"),
    (FP8, ["modules_to_not_convert"], "lm_head", rf"{FIELD}modules_to_not_convert must be a list, got a str"),
    (FP8, ["modules_to_not_convert"], [5], rf"{FIELD}modules_to_not_convert must list module names"),
    (INT4, ["config_groups"], 5, rf"{FIELD}config_groups must be an object, got a number \(5\)"),
    (INT4, ["config_groups"], [], rf"{FIELD}config_groups must be an object, got a list"),
    (INT4, GROUP, "Linear", rf"{G0} must be an object, got a string"),
    (INT4, [*GROUP, "targets"], 5, rf"{G0}\.targets must be a list, got a number"),
    (INT4, [*GROUP, "weights"], [4], rf"{G0}\.weights must be an object, got a list"),
    (INT4, [*GROUP, "weights", "group_size"], "32", rf"{G0}\.weights: .*group_size '32'; .*positive integer"),
    (INT4, [*GROUP, "weights", "group_size"], True, rf"{G0}\.weights: .*group_size True; .*positive integer"),
    (INT4, [*GROUP, "weights", "symmetric"], "false", rf"{G0}\.weights\.symmetric must be true or false"),
    (FP8_BLOCK, [*GROUP, "input_activations"], "fp8", rf"{G0}\.input_activations must be an object"),
    (FP8_BLOCK, [*GROUP, "input_activations", "dynamic"], "no", r"dynamic must be true or false, got a str"),
    (FP8_BLOCK, [*GROUP, "weights", "block_structure"], ["1", "1"], r"block_structure must be .*integers"),
    (GPTQ, ["group_size"], "32", rf"{FIELD}group_size must be a positive integer or -1; got '32'"),
    (GPTQ, ["group_size"], False, rf"{FIELD}group_size must be a positive integer or -1; got False"),
]


@pytest.mark.parametrize("base, path, value, message", CASES)
def test_a_quantization_config_field_of_the_wrong_type_is_named(
    checkpoint, tmp_path, base, path, value, message
):
    def edit(config):
        quantization = copy.deepcopy(base)
        parent = quantization
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value
        config["quantization_config"] = quantization

    _copy(checkpoint, tmp_path, config_edit=edit)
    with pytest.raises(ValueError, match=message):
        load_for_test(tmp_path)
