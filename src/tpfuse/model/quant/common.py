"""What every format shares: UniformConfig (one method for every decoder linear, less the modules
an ignore list leaves unquantized), the errors, the list of supported formats, the check of modules
a checkpoint leaves unquantized."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

SUPPORTED_FORMATS = (
    "compressed-tensors (FP8 float-quantized per-tensor/per-channel/block; "
    "INT4/INT8 pack-quantized symmetric)",
    "fp8 (e4m3 with weight_block_size, weight_scale_inv)",
    "gptq (4/8-bit, desc_act false)",
    "GGUF files (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K)",
)
# The ignore lists that leave only modules tpfuse never quantizes (lm_head, MoE routers) unquantized.
_NEVER_QUANTIZED = ("lm_head", "mlp.gate", "router")


INT_STORED = ("I32",)  # safetensors dtype of packed integer codes
FP8_STORED = ("F8_E4M3",)


def dummy_fp8(dest: torch.Tensor, generator: torch.Generator) -> None:
    """Standard-normal codes (times the dummy scale 0.02: the bf16 dummy weights' spread)."""
    dest.copy_(torch.randn(dest.shape, generator=generator, device=dest.device).to(dest.dtype))


def dummy_scale(dest: torch.Tensor, generator: torch.Generator) -> None:
    dest.fill_(0.02)


def dummy_codes(dest: torch.Tensor, generator: torch.Generator) -> None:
    """Uniformly random packed words (every bit pattern is a valid set of codes)."""
    dest.copy_(
        torch.randint(-(2**31), 2**31, dest.shape, generator=generator, device=dest.device, dtype=torch.int64)
    )


def dummy_group_scale(bits: int):
    """Scales giving uniform codes the bf16 dummy weights' spread (0.02)."""
    value = 0.02 / ((2**bits) / 12**0.5)

    def fill(dest: torch.Tensor, generator: torch.Generator) -> None:
        dest.fill_(value)

    return fill


class QuantizationError(ValueError):
    """A quantization_config tpfuse cannot run; the message names the format or field and what is
    supported."""


_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "an integer", bool: "true or false"}


def json_kind(value) -> str:
    """The JSON type of a parsed config value, for messages: 'a list', 'a string', 'null', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return _JSON_TYPES.get(type(value), type(value).__name__)


def expect(value, kind: type, where: str):
    """value when it has the JSON type kind (a boolean is no integer); else QuantizationError naming
    the field (where), the type it must have and the one it has."""
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise QuantizationError(
        f"{where} must be {_JSON_TYPES[kind]}, got {json_kind(value)} ({value!r}); correct it in config.json"
    )


def typed(container: dict, key: str, kind: type, where: str, default=None):
    """container[key] checked by expect (where.key names it); default when it is absent or null."""
    value = container.get(key)
    return default if value is None else expect(value, kind, f"{where}.{key}")


def supported_list() -> str:
    return "; ".join(SUPPORTED_FORMATS)


def unsupported(name: str, source: str, why: str = "") -> QuantizationError:
    reason = f" ({why})" if why else ""
    return QuantizationError(
        f"{source}: quantization format {name!r}{reason} is not supported; supported: {supported_list()}"
    )


def check_ignored(modules: list[str], where: str) -> None:
    """Modules a format leaves unquantized: tpfuse keeps lm_head and MoE routers unquantized anyway
    and refuses lists naming anything else (those layers would need per-module methods)."""
    others = [m for m in modules if not any(m.rstrip("$").endswith(n) for n in _NEVER_QUANTIZED)]
    if others:
        shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        raise QuantizationError(
            f"{where} leaves {shown} unquantized; tpfuse quantizes every decoder linear alike and supports "
            "ignore lists naming only lm_head or MoE routers"
        )


class ExpertsOnlyConfig:
    """MoE experts in method's format (its experts()), every linear unquantized: what Kimi K2-Thinking's
    ignore list amounts to, for dummy weights of any MoE family."""

    def __init__(self, name: str, method):
        self.name = f"{name} ({method.name} experts, linears unquantized)"
        self.method = method

    def linear_method(self, role: str):
        from tpfuse.model.linear_method import UNQUANTIZED

        return UNQUANTIZED

    def expert_method(self):
        return self.method.experts()


def ignore_matches(entry: str, name: str) -> bool:
    """compressed-tensors' rule: "re:<pattern>" matches by re.match, anything else names a module exactly."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry == name


class UniformConfig:
    """One method for every decoder linear; lm_head stays unquantized (as the checkpoints keep it).

    ignore (where: the config field, for errors): modules the checkpoint leaves unquantized. Linears
    built under a module_prefix (model/linear_method.py) are matched by their checkpoint names; the
    others accept only ignore lists naming lm_head or MoE routers (check_ignored)."""

    def __init__(self, name: str, method, ignore: Sequence[str] = (), where: str = "quantization_config"):
        self.name = f"{name} ({method.name})"
        self.method = method
        self.ignore = tuple(ignore)
        self.where = where
        if self.ignore:
            self.name += f", ignoring {', '.join(self.ignore)}"

    def linear_method(self, role: str):
        from tpfuse.model.linear_method import UNQUANTIZED

        if role == "lm_head":
            return UNQUANTIZED
        check_ignored(list(self.ignore), self.where)
        return self.method

    def _all_or_none_ignored(self, names: tuple[str, ...]) -> bool:
        """True when every name is ignored, False when none is; QuantizationError when they differ."""
        ignored = [n for n in names if any(ignore_matches(entry, n) for entry in self.ignore)]
        if ignored and len(ignored) != len(names):
            kept = [n for n in names if n not in ignored]
            raise QuantizationError(
                f"{self.where} leaves {', '.join(ignored)} unquantized but not {', '.join(kept)}; tpfuse "
                "runs these as one product (one weight format), so the checkpoint must quantize all or none"
            )
        return bool(ignored)

    def linear_method_for(self, role: str, names: tuple[str, ...]):
        """The method of a linear holding checkpoint modules names (merged parts must agree)."""
        from tpfuse.model.linear_method import UNQUANTIZED

        if role == "lm_head" or self._all_or_none_ignored(names):
            return UNQUANTIZED
        return self.method

    def expert_method_for(self, names: tuple[str, ...]):
        """None (unquantized experts) when the ignore list names the experts' modules, else
        expert_method()."""
        return None if self._all_or_none_ignored(names) else self.expert_method()

    def expert_method(self):
        """The MoE experts' method (model/quant/experts.py): the linear method's experts().
        Raises QuantizationError for a format whose experts have none yet."""
        experts = getattr(self.method, "experts", None)
        if experts is None:
            raise QuantizationError(
                f"MoE experts quantized as {self.name} are not supported yet; quantized experts run "
                "compressed-tensors pack-quantized INT4/INT8 with a group size (and --quantization int4)"
            )
        return experts()
