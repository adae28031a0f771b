"""Loading an EAGLE-3 head from a local directory, and writing random ones for tests and benchmarks.

A head directory holds config.json (`LlamaForCausalLMEagle3`) and its weights in model.safetensors
(or several *.safetensors) or pytorch_model.bin, under bare names: fc.weight, midlayer.*, norm.weight,
lm_head.weight, d2t, t2d, and optionally embed_tokens.weight. Some exports prefix names with
`model.` or spell the layer `layers.0.`; both are accepted.
"""

from __future__ import annotations

import glob
import json
import os

import torch

from tpfuse.model.config import ModelConfig
from tpfuse.model.loader import CheckpointError, read_json
from tpfuse.spec.eagle3 import Eagle3Config, Eagle3Head

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "t2d")


def _canonical(name: str) -> str:
    name = name.removeprefix("model.")
    return "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name


def read_head_tensors(directory: str) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors of the head's weight files (names canonicalised), and a description of the files.
    Raises CheckpointError when there are no weight files."""
    paths = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if paths:
        from safetensors.torch import load_file

        tensors = {}
        for path in paths:
            tensors.update({_canonical(k): v for k, v in load_file(path).items()})
        return tensors, ", ".join(paths)
    path = os.path.join(directory, "pytorch_model.bin")
    if os.path.isfile(path):
        state = torch.load(path, map_location="cpu", weights_only=True)
        return {_canonical(k): v for k, v in state.items()}, path
    raise CheckpointError(
        f"no EAGLE-3 weights in {directory}: expected model.safetensors or pytorch_model.bin; "
        "point --speculative-draft-model-path at the head's directory"
    )


def load_eagle3_config(directory: str, dtype: str = "auto") -> Eagle3Config:
    config_path = os.path.join(directory, "config.json")
    hf = read_json(config_path)
    if hf is None:
        raise CheckpointError(
            f"{config_path} not found; --speculative-draft-model-path must be an EAGLE-3 head directory"
        )
    return Eagle3Config.from_hf_dict(hf, dtype, source=config_path)


def load_eagle3_head(
    directory: str,
    target: ModelConfig,
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
) -> Eagle3Head:
    """Builds the head on device in the target's dtype and fills every weight.

    Raises CheckpointError naming the file and tensor for a missing tensor, a wrong shape or an
    unexpected tensor; ValueError when the head does not fit the target (vocabulary, hidden size).
    """
    dtype_name = str(target.dtype).removeprefix("torch.")
    config = load_eagle3_config(directory, dtype_name)
    config.check_target(target, source=os.path.join(directory, "config.json"))
    tensors, files = read_head_tensors(directory)
    with torch.device(device):
        head = Eagle3Head(config, max_positions=max_positions or target.max_position_embeddings)
    if "embed_tokens.weight" in tensors:
        head.embed_tokens = torch.nn.Embedding(target.vocab_size, config.hidden_size, dtype=config.dtype)
        head.embed_tokens.to(device)
    expected = dict(head.named_parameters())
    expected["d2t"] = head.d2t
    for name, dest in expected.items():
        if name not in tensors:
            if name == "d2t" and config.draft_vocab_size == config.vocab_size:
                continue  # same vocabulary: the identity mapping (zeros) is right
            raise CheckpointError(
                f"EAGLE-3 checkpoint {files} is missing tensor {name}; is it a complete "
                "LlamaForCausalLMEagle3 head?"
            )
        source = tensors[name]
        if tuple(source.shape) != tuple(dest.shape):
            raise CheckpointError(
                f"EAGLE-3 checkpoint {files}: tensor {name} has shape {tuple(source.shape)}, but "
                f"config.json implies {tuple(dest.shape)}; the weights and config.json do not match"
            )
        with torch.no_grad():
            dest.copy_(source.to(dest.dtype))
    unexpected = sorted(n for n in tensors if n not in expected and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise CheckpointError(
            f"EAGLE-3 checkpoint {files} has tensors tpfuse does not know: {', '.join(unexpected[:8])}; "
            "only single-layer LlamaForCausalLMEagle3 heads are supported"
        )
    d2t_ok = (head.target_ids_of_draft_vocab() >= 0) & (head.target_ids_of_draft_vocab() < target.vocab_size)
    if not bool(d2t_ok.all()):
        raise CheckpointError(f"EAGLE-3 checkpoint {files}: d2t maps draft ids outside the target vocabulary")
    return head.eval()


def save_random_eagle3_head(
    directory: str,
    target: ModelConfig,
    *,
    draft_vocab_size: int | None = None,
    intermediate_size: int | None = None,
    aux_layer_ids: tuple[int, ...] | None = None,
    weight_format: str = "safetensors",
    seed: int = 0,
    std: float = 0.05,
) -> Eagle3Config:
    """Writes a random EAGLE-3 head for `target` in the public format (config.json + weights).

    The draft vocabulary is a random sorted subset of the target's (d2t offsets, t2d mask); norms are
    ones, matrices normal(0, std). weight_format: "safetensors" or "bin". Returns the head's config.
    """
    if weight_format not in ("safetensors", "bin"):
        raise ValueError(f"weight_format must be safetensors or bin, got {weight_format!r}")
    draft_vocab = draft_vocab_size or target.vocab_size
    hf = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab,
        "target_hidden_size": target.hidden_size,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": target.rope_scaling,
        "max_position_embeddings": target.max_position_embeddings,
        "torch_dtype": "float32",
    }
    if aux_layer_ids is not None:
        hf["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
            "use_aux_hidden_state": True,
        }
    config = Eagle3Config.from_hf_dict(hf)
    head = Eagle3Head(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, param in head.named_parameters():
        is_norm = name.endswith("norm.weight")
        tensors[name] = torch.ones(param.shape) if is_norm else torch.randn(param.shape, generator=gen) * std
    hot = torch.randperm(target.vocab_size, generator=gen)[:draft_vocab].sort().values
    tensors["d2t"] = hot - torch.arange(draft_vocab)
    tensors["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, hot, True)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    if weight_format == "safetensors":
        from safetensors.torch import save_file

        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, os.path.join(directory, "model.safetensors")
        )
    else:
        torch.save(tensors, os.path.join(directory, "pytorch_model.bin"))
    return config
