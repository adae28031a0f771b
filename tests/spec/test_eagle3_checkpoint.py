"""EAGLE-3 heads in the public format: config parsing, load/save round trip, clear errors."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tpfuse.model.loader import CheckpointError
from tpfuse.spec.eagle3 import Eagle3Config
from tpfuse.spec.eagle3_checkpoint import load_eagle3_head, save_random_eagle3_head


def saved_tensors(directory):
    return load_file(os.path.join(directory, "model.safetensors"))


def rewrite_weights(directory, edit):
    tensors = saved_tensors(directory)
    edit(tensors)
    save_file(tensors, os.path.join(directory, "model.safetensors"))


@pytest.mark.parametrize("weight_format", ["safetensors", "bin"])
def test_saved_random_head_loads_back_with_identical_weights(tmp_path, target_config, weight_format):
    save_random_eagle3_head(str(tmp_path), target_config, draft_vocab_size=20, weight_format=weight_format)
    if weight_format == "safetensors":
        tensors = saved_tensors(tmp_path)
    else:
        tensors = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    head = load_eagle3_head(str(tmp_path), target_config)
    for name, param in head.named_parameters():
        assert torch.equal(param, tensors[name].float()), name
    assert torch.equal(head.d2t, tensors["d2t"])


def test_d2t_maps_draft_ids_onto_the_target_ids_marked_in_t2d(tmp_path, target_config):
    save_random_eagle3_head(str(tmp_path), target_config, draft_vocab_size=20)
    head = load_eagle3_head(str(tmp_path), target_config)
    hot = head.target_ids_of_draft_vocab()
    t2d = saved_tensors(tmp_path)["t2d"]
    assert torch.equal(torch.nonzero(t2d)[:, 0], hot)
    assert torch.equal(head.to_target_ids(torch.tensor([0, 19])), hot[[0, 19]])


def test_default_capture_layers_are_two_half_and_n_minus_three(tmp_path, target_config):
    config = save_random_eagle3_head(str(tmp_path), target_config)
    assert config.capture_layers(target_config.num_layers) == (2, 4, 5)


def test_capture_layers_named_in_eagle_config_are_used(tmp_path, target_config):
    config = save_random_eagle3_head(str(tmp_path), target_config, aux_layer_ids=(1, 3, 6, 7))
    assert config.capture_layers(target_config.num_layers) == (1, 3, 6, 7)
    head = load_eagle3_head(str(tmp_path), target_config)
    assert head.fc.weight.shape == (32, 4 * 32)


def test_checkpoint_names_with_model_prefix_or_layers_0_load(tmp_path, target_config):
    save_random_eagle3_head(str(tmp_path), target_config)
    original = saved_tensors(tmp_path)

    def rename(tensors):
        for name in list(tensors):
            new = "model." + name.replace("midlayer.", "layers.0.")
            tensors[new] = tensors.pop(name)

    rewrite_weights(tmp_path, rename)
    head = load_eagle3_head(str(tmp_path), target_config)
    assert torch.equal(head.midlayer.self_attn.q_proj.weight, original["midlayer.self_attn.q_proj.weight"])


def test_head_without_d2t_and_a_full_vocabulary_maps_ids_to_themselves(tmp_path, target_config):
    save_random_eagle3_head(str(tmp_path), target_config)
    rewrite_weights(tmp_path, lambda t: t.pop("d2t"))
    head = load_eagle3_head(str(tmp_path), target_config)
    assert torch.equal(head.target_ids_of_draft_vocab(), torch.arange(target_config.vocab_size))


def test_missing_tensor_is_named_in_the_error(tmp_path, target_config):
    save_random_eagle3_head(str(tmp_path), target_config)
    rewrite_weights(tmp_path, lambda t: t.pop("midlayer.hidden_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor midlayer\.hidden_norm\.weight"):
        load_eagle3_head(str(tmp_path), target_config)


def test_wrong_shape_is_named_with_both_shapes(tmp_path, target_config):
    save_random_eagle3_head(str(tmp_path), target_config)
    rewrite_weights(tmp_path, lambda t: t.update({"fc.weight": torch.zeros(32, 64)}))
    with pytest.raises(CheckpointError, match=r"fc\.weight has shape \(32, 64\).*\(32, 96\)"):
        load_eagle3_head(str(tmp_path), target_config)


def test_unknown_tensors_are_reported(tmp_path, target_config):
    save_random_eagle3_head(str(tmp_path), target_config)
    rewrite_weights(tmp_path, lambda t: t.update({"layers.1.mlp.up_proj.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"does not know: layers\.1\.mlp\.up_proj\.weight"):
        load_eagle3_head(str(tmp_path), target_config)


def test_directory_without_weights_says_which_files_it_expects(tmp_path, target_config):
    save_random_eagle3_head(str(tmp_path), target_config)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors or pytorch_model.bin"):
        load_eagle3_head(str(tmp_path), target_config)


def test_head_for_another_vocabulary_is_refused(tmp_path, target_config):
    save_random_eagle3_head(str(tmp_path), target_config)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf["vocab_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="vocab_size 64 but the target model has 50"):
        load_eagle3_head(str(tmp_path), target_config)


def test_config_of_a_plain_model_is_refused_as_not_an_eagle3_head():
    with pytest.raises(ValueError, match="EAGLE-3"):
        Eagle3Config.from_hf_dict({"architectures": ["LlamaForCausalLM"], "hidden_size": 8})


def test_multi_layer_heads_are_refused():
    hf = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_attention_heads": 2,
        "vocab_size": 10,
        "num_hidden_layers": 2,
    }
    with pytest.raises(ValueError, match="single-layer"):
        Eagle3Config.from_hf_dict(hf)


def test_public_config_fields_are_parsed():
    hf = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "vocab_size": 1000,
        "draft_vocab_size": 100,
        "target_hidden_size": 96,
        "torch_dtype": "float16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 9], "use_aux_hidden_state": True},
    }
    config = Eagle3Config.from_hf_dict(hf)
    assert (config.draft_vocab_size, config.target_hidden_size, config.head_dim) == (100, 96, 16)
    assert config.aux_layer_ids == (1, 5, 9)
    assert config.dtype == torch.float16


def test_head_built_under_a_device_context_puts_every_weight_on_that_device(tmp_path):
    # the loader builds the head inside `with torch.device(device)`; a module that materializes its
    # weights elsewhere (nn.utils.skip_init defaults to cpu) would leave the head split across devices
    from tpfuse.config import EngineConfig
    from tpfuse.model.loader import load_model_config
    from tpfuse.spec.eagle3 import Eagle3Head
    from tpfuse.spec.eagle3_checkpoint import load_eagle3_config

    target = load_model_config(EngineConfig(model="tiny"))
    save_random_eagle3_head(str(tmp_path), target, draft_vocab_size=64, aux_layer_ids=(0, 1, 2))
    config = load_eagle3_config(str(tmp_path), "float32")
    with torch.device("meta"):
        head = Eagle3Head(config, max_positions=16)
    devices = {t.device.type for t in (*head.parameters(), *head.buffers())}
    assert devices == {"meta"}
