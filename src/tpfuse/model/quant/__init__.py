"""Quantized checkpoints: quantization_config (config.json) -> a QuantConfig that gives every
parallel linear its LinearMethod (model/linear_method.py). One file per format; FORMATS is the registry.

`from_hf_config(hf, source)` reads a checkpoint's; `for_dummy(name)` makes one for
--load-format dummy --quantization fp8|fp8-block|int4|int4-experts (random quantized weights at real
shapes).
"""

from __future__ import annotations

from collections.abc import Callable

from tpfuse.model.linear_method import QuantConfig
from tpfuse.model.quant import compressed_tensors, fp8, gptq
from tpfuse.model.quant.common import (
    ExpertsOnlyConfig,
    QuantizationError,
    UniformConfig,
    supported_list,
    typed,
    unsupported,
)
from tpfuse.model.quant.int_group import IntGroupLinearMethod

FORMATS: dict[str, Callable[[dict, str], QuantConfig]] = {
    "compressed-tensors": compressed_tensors.parse,
    "fp8": fp8.parse_fp8,
    "gptq": gptq.parse_gptq,
}
DUMMY_QUANTIZATIONS = ("fp8", "fp8-block", "int4", "int4-experts")

__all__ = ["DUMMY_QUANTIZATIONS", "FORMATS", "QuantizationError", "for_dummy", "from_hf_config"]


def from_hf_config(hf: dict, source: str = "config.json") -> QuantConfig | None:
    """None for an unquantized checkpoint. Raises QuantizationError naming the format or field and
    listing what is supported (AWQ, NVFP4, MXFP4, bitsandbytes, act-order GPTQ, ... are refused)."""
    qc = hf.get("quantization_config") or hf.get("compression_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise QuantizationError(f"{source}: quantization_config must be an object; got {type(qc).__name__}")
    name = typed(qc, "quant_method", str, f"{source}: quantization_config")
    if name not in FORMATS:
        raise unsupported(str(name), source)
    return FORMATS[name](qc, source)


def for_dummy(name: str) -> QuantConfig:
    """fp8: per-channel FP8; fp8-block: 128x128 block FP8; int4: INT4 group 128 (symmetric);
    int4-experts: INT4 group 32 MoE experts, every linear unquantized (Kimi K2-Thinking's layout)."""
    if name == "fp8":
        return UniformConfig(f"dummy {name}", fp8.Fp8LinearMethod("channel"))
    if name == "fp8-block":
        return UniformConfig(f"dummy {name}", fp8.Fp8LinearMethod("block", (128, 128)))
    if name == "int4":
        return UniformConfig(f"dummy {name}", IntGroupLinearMethod(4, 128, fmt="int"))
    if name == "int4-experts":
        return ExpertsOnlyConfig(f"dummy {name}", IntGroupLinearMethod(4, 32, fmt="int"))
    raise ValueError(
        f"--quantization {name!r} is not one of {', '.join(DUMMY_QUANTIZATIONS)}; "
        f"checkpoints may use: {supported_list()}"
    )
