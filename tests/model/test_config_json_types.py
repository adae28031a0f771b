"""config.json values of the wrong JSON type fail with one error naming config.json, the field and the
fix, whichever reader meets them first: transformers (the tokenizer loads the config through
AutoConfig, and transformers 5 checks field types strictly: an int where a float is due is refused)
or tpfuse's own ModelConfig."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import transformers

from tests.model.test_tokenizer import save_hf_tokenizer
from tpfuse.config import EngineConfig
from tpfuse.model.loader import load_model_config
from tpfuse.model.tokenizer import load_tokenizer

STRICT = int(transformers.__version__.split(".")[0]) >= 5
strict_only = pytest.mark.skipif(not STRICT, reason="transformers 4.x does not type config fields strictly")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=400,
        max_position_embeddings=256,
    ).save_pretrained(directory)
    save_hf_tokenizer(directory, None)
    return directory


def _with(src, dst, **fields):
    for file in src.iterdir():
        if file.name != "config.json":
            (dst / file.name).symlink_to(file)
    config = json.loads((src / "config.json").read_text())
    config.update(fields)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@strict_only
@pytest.mark.parametrize(
    "field, value, fix",
    [
        ("rms_norm_eps", 1, r"expected float, got int \(value: 1\)\); write it as 1\.0 \(a float\)"),
        ("initializer_range", 0, r"expected float, got int \(value: 0\)\); write it as 0\.0 \(a float\)"),
        (
            "hidden_size",
            "64",
            r"expected int, got str \(value: '64'\)\); write it as 64 \(a number, no quotes\)",
        ),
        ("max_position_embeddings", 256.0, r"write it as 256 \(an integer\)"),
        ("head_dim", "16", r"doesn't match any type in \(int, NoneType\)\); write it as 16 \(a number"),
        ("tie_word_embeddings", "yes", r"expected bool, got str \(value: 'yes'\)\); give it the type"),
    ],
)
def test_a_field_transformers_refuses_is_named_with_config_json_and_the_fix(
    llama_dir, tmp_path, field, value, fix
):
    directory = _with(llama_dir, tmp_path, **{field: value})
    path = re.escape(str(directory / "config.json"))
    with pytest.raises(
        ValueError, match=rf"^{path}: transformers refuses field {field} \(.*{fix}.* in config\.json$"
    ):
        load_tokenizer(str(directory))


def test_an_int_where_transformers_wants_a_float_is_fine_for_tpfuse_itself(llama_dir, tmp_path):
    directory = _with(llama_dir, tmp_path, rms_norm_eps=1, initializer_range=0)
    assert load_model_config(EngineConfig(model=str(directory))).rms_norm_eps == 1


@strict_only
def test_generate_reports_it_in_one_line(llama_dir, tmp_path):
    directory = _with(llama_dir, tmp_path, rms_norm_eps=1)
    command = [sys.executable, "-m", "tpfuse", "generate", "--model", str(directory), "--device", "cpu"]
    proc = subprocess.run([*command, "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert f"{directory / 'config.json'}: transformers refuses field rms_norm_eps" in line
    assert "write it as 1.0 (a float) in config.json" in line


@strict_only
def test_other_transformers_failures_on_config_json_are_a_value_error_naming_it(llama_dir, tmp_path):
    directory = _with(llama_dir, tmp_path, dtype=["float32"])  # transformers: IndexError
    with pytest.raises(ValueError, match=r"transformers failed reading config\.json .*\(IndexError: "):
        load_tokenizer(str(directory))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"rope_scaling": 5}, r"config\.json rope_scaling must be an object \(or null\); got 5"),
        (
            {"rope_parameters": "default"},
            r"config\.json rope_parameters must be an object \(or null\); got 'default'",
        ),
        ({"architectures": "LlamaForCausalLM"}, r"config\.json architectures must be a list of class names"),
        ({"head_dim": "16"}, r"config\.json: model config head_dim must be an integer >= 1, got '16'"),
        (
            {"rms_norm_eps": "1e-5"},
            r"config\.json: model config rms_norm_eps must be a positive finite number",
        ),
    ],
)
def test_tpfuses_own_config_reader_names_config_json_and_the_field(llama_dir, tmp_path, fields, message):
    directory = _with(llama_dir, tmp_path, **fields)
    with pytest.raises(ValueError, match=message):
        load_model_config(EngineConfig(model=str(directory)))


@pytest.mark.parametrize("value", ["2", 2.0, True, ["1", 2]])
def test_an_eos_token_id_that_is_not_a_number_is_refused_naming_the_file(tmp_path, value):
    """A quoted or fractional eos id used to be passed through int() (2.5 became 2)."""
    from tpfuse.model.config import ModelConfig

    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
          "eos_token_id": value}  # fmt: skip
    source = str(tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"config\.json: eos_token_id must be a token id"):
        ModelConfig.from_hf_dict(hf, source=source)
    hf["eos_token_id"] = 2
    with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id must be a token id"):
        ModelConfig.from_hf_dict(hf, generation_config={"eos_token_id": value}, source=source)
    config = ModelConfig.from_hf_dict(hf, generation_config={"eos_token_id": [3, 2]}, source=source)
    assert config.eos_token_ids == (2, 3)
