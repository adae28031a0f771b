"""GPTQ checkpoints (`quant_method: gptq`, 4 or 8 bits, desc_act false), as AutoGPTQ/GPTQModel store them:

  <name>.qweight [K / V, N] int32   V = 32 / bits values per word, packed along K, low bits first
  <name>.qzeros  [K / g, N / V] int32  zero points packed along N; checkpoint_format "gptq" stores
                                        zero - 1, "gptq_v2" the zero itself
  <name>.scales  [K / g, N] float16
  <name>.g_idx   [K] int32            must be k // g (act-order checkpoints are refused)

w = (q - zero) * scale. qweight transposed is already the kernels' packed layout; the zero points
become float32 offsets -zero * scale (exact), or none when every zero is 2^(bits-1).
"""

from __future__ import annotations

import torch
from torch import nn

from tpfuse.kernels.quant_int import unpack_int, values_per_word
from tpfuse.model.linear_method import LinearShards
from tpfuse.model.quant.common import INT_STORED, dummy_codes, dummy_group_scale
from tpfuse.model.quant.int_group import IntGroupLinearMethod
from tpfuse.model.shard import ShardSlot, empty_parameter


class GptqLinearMethod(IntGroupLinearMethod):
    def __init__(self, bits: int, group_size: int, zero_plus_one: bool):
        super().__init__(bits, group_size, torch.float16, fmt="gptq int")
        self.zero_plus_one = zero_plus_one

    def create_weights(self, layer: nn.Module, shards: LinearShards, dtype: torch.dtype) -> None:
        group = self.group_of(shards)
        self._check_row_split(shards, group)
        per_word = values_per_word(self.bits)
        for full, start, local in shards.parts:
            if start % per_word or local % per_word:
                raise ValueError(
                    f"GPTQ zero points pack {per_word} output columns per word, but this rank holds rows "
                    f"{start}..{start + local} of {full}; "
                    "choose a --tp-size that splits them into whole words"
                )
        groups, k_words = -(-shards.k_local // group), -(-shards.k_local // per_word)
        layer.qweight = empty_parameter(k_words, shards.n_local, dtype=torch.int32)
        layer.qzeros = empty_parameter(groups, shards.n_local // per_word, dtype=torch.int32)
        layer.scales = empty_parameter(groups, shards.n_local, dtype=torch.float16)
        layer.g_idx = empty_parameter(len(shards.parts) * shards.k_local, dtype=torch.int32)
        layer.int_group = group

    def checkpoint_slots(self, layer: nn.Module, part: int) -> dict[str, ShardSlot]:
        shards: LinearShards = layer.shards
        full, start, local = shards.parts[part]
        offset = shards.row_offset(part)
        per_word, group = values_per_word(self.bits), layer.int_group
        k_full, k_start, k_local = shards.input_full, shards.input_start, shards.k_local
        k_words, groups = -(-k_full // per_word), -(-k_full // group)
        codes = {"stored_dtypes": INT_STORED, "dummy": dummy_codes}
        scale = {"stored_dtypes": ("F16", "BF16", "F32"), "dummy": dummy_group_scale(self.bits)}

        def dummy_zeros(dest, generator):
            middle = 2 ** (self.bits - 1) - (1 if self.zero_plus_one else 0)
            word = sum(middle << (self.bits * i) for i in range(per_word))
            dest.fill_(word - (1 << 32) if word >= 1 << 31 else word)

        def dummy_g_idx(dest, generator):
            dest.copy_(torch.arange(k_start, k_start + k_local, device=dest.device) // group)

        zeros = {"stored_dtypes": INT_STORED, "dummy": dummy_zeros}
        g_idx = ShardSlot(layer.g_idx, (k_full,), 0, k_start, k_local, part * k_local, stored_dtypes=("I32",),
                          dummy=dummy_g_idx)  # fmt: skip
        if shards.input_sharded:
            return {
                "qweight": ShardSlot(
                    layer.qweight, (k_words, full), 0, k_start // per_word, layer.qweight.shape[0], **codes
                ),  # fmt: skip
                "qzeros": ShardSlot(
                    layer.qzeros,
                    (groups, full // per_word),
                    0,
                    k_start // group,
                    layer.qzeros.shape[0],
                    **zeros,
                ),  # fmt: skip
                "scales": ShardSlot(
                    layer.scales, (groups, full), 0, k_start // group, layer.scales.shape[0], **scale
                ),
                "g_idx": g_idx,
            }
        return {
            "qweight": ShardSlot(layer.qweight, (k_words, full), 1, start, local, offset, **codes),
            "qzeros": ShardSlot(
                layer.qzeros,
                (groups, full // per_word),
                1,
                start // per_word,
                local // per_word,
                offset // per_word,
                **zeros,
            ),  # fmt: skip
            "scales": ShardSlot(layer.scales, (groups, full), 1, start, local, offset, **scale),
            "g_idx": g_idx,
        }

    experts = None  # GPTQ MoE experts: not supported (UniformConfig.expert_method says so)

    def process_weights(self, layer: nn.Module) -> None:
        shards: LinearShards = layer.shards
        group = layer.int_group
        expected = torch.arange(
            shards.input_start, shards.input_start + shards.k_local, device=layer.g_idx.device
        )
        names = getattr(layer, "checkpoint_names", None) or ["a GPTQ linear"] * len(shards.parts)
        for part, name in enumerate(names):
            found = layer.g_idx.data[part * shards.k_local : (part + 1) * shards.k_local]
            if not torch.equal(found.long(), expected // group):
                raise ValueError(
                    f"{name}.g_idx is not k // group_size ({group}): an act-order (desc_act) checkpoint, "
                    "which "
                    "tpfuse does not support; use a GPTQ export with desc_act false"
                )
        zeros = unpack_int(layer.qzeros.data, self.bits, shards.n_local)
        if self.zero_plus_one:
            zeros = zeros + 1
        scales = layer.scales.data.T.contiguous()
        packed = layer.qweight.data.T.contiguous()
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            delattr(layer, name)
        layer.weight_packed = nn.Parameter(packed, requires_grad=False)
        layer.weight_scale = nn.Parameter(scales, requires_grad=False)
        if bool((zeros == 2 ** (self.bits - 1)).all()):
            layer.weight_offset = None
        else:
            offsets = -zeros.T.float() * scales.float()
            layer.weight_offset = nn.Parameter(offsets.contiguous(), requires_grad=False)


def parse_gptq(qc: dict, source: str):
    """Raises QuantizationError naming the field tpfuse cannot run (act-order, lm_head, 2/3 bits...)."""
    from tpfuse.model.quant.common import QuantizationError, UniformConfig, unsupported

    where = f"{source}: quantization_config"
    if qc.get("desc_act"):
        raise unsupported("gptq", source, "desc_act true: act-order GPTQ; use an export with desc_act false")
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise QuantizationError(f"{where}.bits {bits!r} is not supported; tpfuse runs 4- and 8-bit GPTQ")
    group_size = qc.get("group_size", 128)
    if type(group_size) is not int or (group_size < 1 and group_size != -1):
        raise QuantizationError(f"{where}.group_size must be a positive integer or -1; got {group_size!r}")
    if qc.get("lm_head"):
        raise QuantizationError(f"{where}.lm_head true (a quantized lm_head) is not supported")
    if qc.get("dynamic"):
        raise QuantizationError(f"{where}.dynamic (per-module overrides) is not supported")
    checkpoint_format = qc.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise QuantizationError(
            f"{where}.checkpoint_format {checkpoint_format!r} is not one of gptq, gptq_v2"
        )
    return UniformConfig(
        "gptq", GptqLinearMethod(bits, group_size, zero_plus_one=checkpoint_format == "gptq")
    )
