"""GGUF files (llama.cpp): the model config from the metadata, and every tensor under its Hugging
Face name, ready for the loader's ShardSlots.

Linears stored as Q8_0, Q4_0 or Q4_1 keep their codes: the 32-value blocks are repacked into the
group-quantized kernels' layout (kernels/quant_int.py; group 32: Q4_0 w = (q - 8) d, Q4_1
w = q d + m, Q8_0 w = q d) under the names model/quant/gguf.py gives them. Everything else (F32, F16,
BF16, Q4_K, Q6_K, embeddings, norms) is dequantized at load (the gguf package's numpy reference).
llama.cpp stores Llama's q/k rows interleaved for its rotary layout; they are permuted back here.
Parsing uses the `gguf` package.
"""

from __future__ import annotations

import functools
import os
import re

import numpy as np
import torch

from tpfuse.model.gguf_check import check_container

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
GROUP_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # type -> bits, run by the group kernels
DEQUANTIZED_TYPES = ("F32", "F16", "BF16", "Q4_K", "Q6_K")
GROUP_SIZE = 32
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def damaged(path: str, error: Exception) -> str:
    """The message for a file the gguf reader fails on: a cut download, or not a GGUF file at all."""
    with open(path, "rb") as f:
        magic = f.read(4)
    reason = f"{type(error).__name__}: {' '.join(str(error).split())}"
    if not b"GGUF".startswith(magic):
        return f"{path} is not a GGUF file (it does not start with the GGUF magic; {reason}); re-download it"
    return (
        f"{path} is truncated or damaged ({os.path.getsize(path)} bytes; reading its header, metadata or "
        f"tensor data failed with {reason}); re-download it"
    )


def hf_name(gguf_name: str) -> str | None:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight (None: nothing tpfuse runs)."""
    base, _, suffix = gguf_name.rpartition(".")
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{suffix}"
    return f"{_TOP_NAMES[base]}.{suffix}" if base in _TOP_NAMES else None


class GgufFile:
    """One .gguf file: metadata, tensor types by Hugging Face name, tensors converted on demand."""

    def __init__(self, path: str):
        from gguf import GGUFReader

        self.path = path
        try:
            check_container(path)  # counts and lengths first: the reader trusts them
            self.reader = GGUFReader(path)  # parses every metadata value and tensor extent
        except OSError as e:
            raise ValueError(f"{path} could not be read ({e}); check that it is a readable file") from e
        except Exception as e:  # the gguf package fails on whatever a cut or corrupted file makes it hit
            raise ValueError(damaged(path, e)) from e
        self.architecture = self.field("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"{path}: GGUF architecture {self.architecture!r} is not supported; supported: "
                f"{', '.join(ARCHITECTURES)}"
            )
        self.tensors = {}
        for tensor in self.reader.tensors:
            name = hf_name(tensor.name)
            if name is None:
                raise ValueError(f"{path}: tensor {tensor.name} has no place in a {self.architecture} model")
            kind = tensor.tensor_type.name
            if kind not in GROUP_TYPES and kind not in DEQUANTIZED_TYPES:
                raise ValueError(
                    f"{path}: tensor {tensor.name} is {kind}; tpfuse reads "
                    f"{', '.join(DEQUANTIZED_TYPES + tuple(GROUP_TYPES))} GGUF tensors"
                )
            self.tensors[name] = tensor

    def field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def hf_config(self) -> dict:
        """A config.json-like dict of the model the metadata describes."""
        a = self.architecture

        def get(key, default=None):
            return self.field(f"{a}.{key}", default)

        for key in ("block_count", "embedding_length", "attention.head_count", "feed_forward_length"):
            if get(key) is None:
                raise ValueError(
                    f"{self.path} has no {a}.{key} metadata; the file is incomplete: re-download it"
                )
        if get("vocab_size") is None and self.field("tokenizer.ggml.tokens") is None:
            raise ValueError(
                f"{self.path} has neither {a}.vocab_size nor tokenizer.ggml.tokens metadata; the file is "
                "incomplete: re-download it"
            )
        heads = get("attention.head_count")
        hidden = get("embedding_length")
        config = {
            "architectures": [ARCHITECTURES[a]],
            "hidden_size": hidden,
            "num_hidden_layers": get("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": get("attention.head_count_kv", heads),
            "head_dim": get("attention.key_length", hidden // heads),
            "intermediate_size": get("feed_forward_length"),
            "vocab_size": get("vocab_size") or len(self.field("tokenizer.ggml.tokens")),
            "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": get("rope.freq_base", 10000.0),
            "max_position_embeddings": get("context_length", 2048),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
        }
        scaling = get("rope.scaling.type")
        if scaling not in (None, "none"):
            raise ValueError(f"{self.path}: {a}.rope.scaling.type {scaling!r} is not supported")
        return config

    def tensor_type(self, name: str) -> str | None:
        tensor = self.tensors.get(name)
        return None if tensor is None else tensor.tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """The Hugging Face shape (GGUF lists dims fastest first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def _row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """llama.cpp interleaves Llama's q/k rows per head; the order that undoes it."""
        if self.architecture != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
            return None
        key = "attention.head_count" if "q_proj" in name else "attention.head_count_kv"
        heads = self.field(f"llama.{key}")
        half = rows // heads // 2
        return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)

    def dequantized(self, name: str) -> torch.Tensor:
        """The float32 tensor under its Hugging Face name and shape."""
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        values = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type)))  # a writable copy
        values = values.float().reshape(self.shape(name))
        order = self._row_order(name, values.shape[0]) if values.dim() == 2 else None
        return values if order is None else values[order]

    def group_quantized(self, name: str) -> dict[str, torch.Tensor]:
        """A Q4_0/Q4_1/Q8_0 weight [N, K] as {"weight_packed", "weight_scale" (fp16), and for Q4_1
        "weight_offset" (float32)} in the kernels' layout (kernels/quant_int.py)."""
        tensor = self.tensors[name]
        kind = tensor.tensor_type.name
        n, k = self.shape(name)
        blocks = torch.from_numpy(np.array(tensor.data)).view(n, k // GROUP_SIZE, -1)  # a writable copy
        out = {"weight_scale": blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)}
        if kind == "Q8_0":  # int8 codes + 128, four to a little-endian word
            codes = blocks[..., 2:] ^ 0x80
        else:  # a block's low nibbles are values 0-15, its high nibbles 16-31
            if kind == "Q4_1":
                out["weight_offset"] = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
            qs = blocks[..., 4 if kind == "Q4_1" else 2 :]
            values = torch.cat([qs & 0xF, qs >> 4], dim=-1)
            codes = values[..., 0::2] | (values[..., 1::2] << 4)
        out["weight_packed"] = codes.contiguous().view(torch.int32).reshape(n, -1)
        order = self._row_order(name, n)
        return out if order is None else {key: t[order].contiguous() for key, t in out.items()}


@functools.cache
def open_gguf(path: str) -> GgufFile:
    """The parsed file, once per process (memory-mapped). Raises ValueError for a bad file."""
    return GgufFile(path)
