"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, as llm-compressor writes them):
one config group targeting Linear, with
  - float-quantized 8-bit weights (strategy tensor, channel or block): FP8 (model/quant/fp8.py);
  - pack-quantized 4- or 8-bit symmetric int weights, strategy group (the Kimi K2 layout) or
    channel: W4A16 / W8A16 (model/quant/int_group.py).
The ignore list's modules stay unquantized where the model family names its linears (DeepSeek-V3:
Kimi K2's INT4 routed experts beside bf16 attention, shared experts and dense MLPs).
Activations: none (weight-only), or FP8 ones (W8A8: quantized dynamically, model/quant/fp8.py says how).
"""

from __future__ import annotations

from tpfuse.model.quant.common import QuantizationError, UniformConfig, expect, typed
from tpfuse.model.quant.fp8 import Fp8LinearMethod
from tpfuse.model.quant.int_group import IntGroupLinearMethod

SUPPORTED = (
    "float-quantized FP8 (tensor, channel, block) and pack-quantized INT4/INT8 (symmetric group, channel)"
)


def parse(qc: dict, source: str) -> UniformConfig:
    """Raises QuantizationError naming the field of quantization_config that tpfuse cannot run."""
    groups = typed(qc, "config_groups", dict, f"{source}: quantization_config", {})
    if len(groups) != 1:
        raise QuantizationError(
            f"{source}: quantization_config.config_groups has {len(groups)} groups; tpfuse runs one group "
            f"that targets every Linear ({SUPPORTED})"
        )
    ((group_name, group),) = groups.items()
    where = f"{source}: quantization_config.config_groups.{group_name}"
    expect(group, dict, where)
    if "Linear" not in typed(group, "targets", list, where, []):
        raise QuantizationError(f'{where}.targets must include "Linear"; got {group.get("targets")}')
    if qc.get("kv_cache_scheme"):
        raise QuantizationError(
            f"{source}: quantization_config.kv_cache_scheme (a quantized KV cache) is not supported"
        )
    ignore = qc.get("ignore") or []
    if not (isinstance(ignore, list) and all(isinstance(entry, str) for entry in ignore)):
        raise QuantizationError(
            f"{source}: quantization_config.ignore must be a list of module names; got {ignore!r}"
        )

    def uniform(method) -> UniformConfig:
        return UniformConfig("compressed-tensors", method, ignore, f"{source}: quantization_config.ignore")

    weights = typed(group, "weights", dict, where, {})
    fmt = group.get("format") or qc.get("format")
    activations = typed(group, "input_activations", dict, where)
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    if kind == "float":
        if bits != 8 or fmt not in ("float-quantized", "naive-quantized"):
            raise QuantizationError(
                f"{where}: float weights of {bits} bits in format {fmt!r} are not supported; "
                f"supported: {SUPPORTED}"
            )
        _check_fp8_activations(activations, where)
        static = bool(activations) and not typed(activations, "dynamic", bool, f"{where}.input_activations")
        if strategy == "block":
            block = weights.get("block_structure")
            if not (isinstance(block, list) and len(block) == 2 and all(_positive_int(b) for b in block)):
                raise QuantizationError(
                    f"{where}.weights.block_structure must be [block_n, block_k] of positive integers; "
                    f"got {block!r}"
                )
            return uniform(Fp8LinearMethod("block", tuple(block), static, bool(activations)))
        if strategy not in ("tensor", "channel"):
            raise QuantizationError(
                f"{where}.weights.strategy {strategy!r} is not supported; supported: {SUPPORTED}"
            )
        return uniform(Fp8LinearMethod(strategy, None, static, bool(activations)))
    if kind == "int":
        if fmt != "pack-quantized" or bits not in (4, 8):
            raise QuantizationError(
                f"{where}: int weights of {bits} bits in format {fmt!r} are not supported; "
                f"supported: {SUPPORTED}"
            )
        if not typed(weights, "symmetric", bool, f"{where}.weights", True):
            raise QuantizationError(
                f"{where}.weights.symmetric is false; tpfuse runs symmetric pack-quantized only"
            )
        if weights.get("actorder"):
            raise QuantizationError(f"{where}.weights.actorder {weights['actorder']!r} is not supported")
        if activations:
            raise QuantizationError(f"{where}.input_activations: int weights run weight-only (W4A16/W8A16)")
        if strategy == "channel":
            return uniform(IntGroupLinearMethod(bits, -1, fmt="int"))
        group_size = weights.get("group_size")
        if strategy != "group" or not _positive_int(group_size):
            raise QuantizationError(
                f"{where}.weights: strategy {strategy!r} with group_size {group_size!r}; int weights need "
                "strategy group with a positive integer group_size, or strategy channel"
            )
        return uniform(IntGroupLinearMethod(bits, group_size, fmt="int"))
    raise QuantizationError(f"{where}.weights.type {kind!r} is not supported; supported: {SUPPORTED}")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_fp8_activations(activations: dict | None, where: str) -> None:
    if not activations:
        return
    if activations.get("type") != "float" or activations.get("num_bits") != 8:
        raise QuantizationError(
            f"{where}.input_activations: {activations.get('type')} {activations.get('num_bits')}-bit "
            "activations "
            "are not supported with FP8 weights (FP8 or none)"
        )
