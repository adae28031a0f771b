"""Tiny quantized checkpoints in the exact public on-disk layouts, written by the tests.

Each writer quantizes a random transformers model's decoder linears (q, k, v, o, gate, up, down)
into a format's tensors, writes them with the rest of the model (embeddings, norms, lm_head in
float32) and config.json's quantization_config, and loads the dequantized weights back into the
transformers model, so both engines run exactly the same numbers.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from tests.engine.checkpoints import BOS, EOS, VOCAB, save_byte_tokenizer
from tests.model.harness import build_hf_checkpoint

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8 = torch.float8_e4m3fn


def _pack_along(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values packed 32 / bits per int32 along dim, the first value in the lowest bits."""
    per_word = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per_word)
    words = sum(v[..., i] << (bits * i) for i in range(per_word))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def fp8_channel(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    scale = (w.abs().amax(1, keepdim=True) / 448).to(torch.bfloat16)
    q = (w / scale.float()).to(FP8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale.float()


def fp8_tensor(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    scale = (w.abs().max() / 448).reshape(1).float()
    q = (w / scale).to(FP8)
    return {"weight": q, "weight_scale": scale, "input_scale": torch.tensor([0.05])}, q.float() * scale


def fp8_block(w: torch.Tensor, block: int = 128) -> tuple[dict, torch.Tensor]:
    n, k = w.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = torch.zeros(rows * block, cols * block)
    padded[:n, :k] = w
    amax = padded.view(rows, block, cols, block).abs().amax((1, 3))
    scale_inv = amax / 448
    expanded = scale_inv.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    q = (w / expanded).to(FP8)
    return {"weight": q, "weight_scale_inv": scale_inv}, q.float() * expanded


def int_pack_quantized(w: torch.Tensor, bits: int, group: int) -> tuple[dict, torch.Tensor]:
    """compressed-tensors pack-quantized, symmetric: q in [-2^(b-1), 2^(b-1) - 1], stored + 2^(b-1)."""
    n, k = w.shape
    half = 2 ** (bits - 1)
    grouped = w.view(n, k // group, group)
    scale = (grouped.abs().amax(-1) / (half - 1)).to(torch.bfloat16)
    q = torch.round(grouped / scale.float()[..., None]).clamp(-half, half - 1).view(n, k)
    dequantized = (q.view(n, k // group, group) * scale.float()[..., None]).view(n, k)
    tensors = {
        "weight_packed": _pack_along(q + half, bits, 1),
        "weight_scale": scale,
        "weight_shape": torch.tensor([n, k]),
    }
    return tensors, dequantized


def gptq_asymmetric(w: torch.Tensor, bits: int, group: int) -> tuple[dict, torch.Tensor]:
    """GPTQ (checkpoint_format gptq: zero points stored minus one), desc_act false, asymmetric."""
    n, k = w.shape
    top = 2**bits - 1
    grouped = w.view(n, k // group, group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low) / top).clamp(min=1e-6).to(torch.float16)
    zero = torch.round(-low / scale.float()).clamp(1, top)
    q = torch.round(grouped / scale.float()[..., None] + zero[..., None]).clamp(0, top)
    dequantized = ((q - zero[..., None]) * scale.float()[..., None]).view(n, k)
    tensors = {
        "qweight": _pack_along(q.view(n, k).T, bits, 0),
        "qzeros": _pack_along((zero - 1).T, bits, 1),
        "scales": scale.T.contiguous(),
        "g_idx": (torch.arange(k) // group).to(torch.int32),
    }
    return tensors, dequantized


def write_quantized(directory, kind: str, quantizer, quantization_config: dict, seed: int = 0, **shape):
    """Saves a random model of architecture kind with its decoder linears (and experts) in quantizer's
    layout; returns the transformers model of the dequantized weights (loaded from a float copy of
    the checkpoint, so transformers maps the on-disk names itself, per-expert ones included)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    build_hf_checkpoint(
        directory,
        kind,
        seed=seed,
        vocab_size=VOCAB,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=EOS,
        **shape,
    )
    save_byte_tokenizer(directory)
    files = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    state = {}
    for file in files:
        state.update(load_file(os.path.join(directory, file)))
        os.remove(os.path.join(directory, file))
    if os.path.exists(os.path.join(directory, "model.safetensors.index.json")):
        os.remove(os.path.join(directory, "model.safetensors.index.json"))
    tensors, dequantized_state = {}, {}
    for name, tensor in state.items():
        prefix, _, last = name.rpartition(".")
        if last == "weight" and prefix.rsplit(".", 1)[-1] in PROJECTIONS:
            stored, dequantized = quantizer(tensor.float())
            tensors.update({f"{prefix}.{suffix}": t for suffix, t in stored.items()})
            dequantized_state[name] = dequantized
        else:
            tensors[name] = tensor
            dequantized_state[name] = tensor
    reference = os.path.join(directory, "dequantized")
    os.makedirs(reference, exist_ok=True)
    save_file(dequantized_state, os.path.join(reference, "model.safetensors"))
    config_path = os.path.join(directory, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(os.path.join(reference, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    config["quantization_config"] = quantization_config
    with open(config_path, "w") as f:
        json.dump(config, f)
    return AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()


def compressed_tensors_config(weights: dict, fmt: str, input_activations: dict | None = None) -> dict:
    """quantization_config as llm-compressor writes it for one group targeting Linear."""
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"dynamic": False, "observer": "minmax", "actorder": None, **weights},
                "input_activations": input_activations,
                "output_activations": None,
            }
        },
    }


def load_tensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


def save_tensors(directory, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, os.path.join(directory, "model.safetensors"))
