"""ModelConfig: the shape of a decoder (dense or mixture-of-experts), read from a Hugging Face
config.json or a preset.

Both transformers 4.x files (`rope_theta`, `rope_scaling`, `torch_dtype`) and 5.x files
(`rope_parameters`, `dtype`) are understood.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from tpfuse.model.mla_config import GroupedRouting, MLAShape, grouped_routing, mla_shape
from tpfuse.model.registry import SUPPORTED_ARCHITECTURES

_ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
}
_QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_SLIDING_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM")
_MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Hugging Face rope_scaling dict (type "llama3" or None)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3)
    # Mixture of experts (0 experts: dense). A layer is sparse when is_moe_layer(i) says so.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # one expert's intermediate size
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    # DeepSeek-V3 family (model/mla_config.py): latent attention, group-limited routing + shared experts
    mla: MLAShape | None = None
    grouped_routing: GroupedRouting | None = None
    dtype: torch.dtype = torch.bfloat16
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                     "intermediate_size"):  # fmt: skip
            _check_count(name, getattr(self, name), 1)
        _check_count("max_position_embeddings", self.max_position_embeddings, 2)
        positive = {"rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta}
        if self.rope_scaling and "factor" in self.rope_scaling:
            positive["rope_scaling.factor"] = self.rope_scaling["factor"]
        if self.grouped_routing is not None:
            positive["routed_scaling_factor"] = self.grouped_routing.routed_scaling_factor
        for name, value in positive.items():  # zero or negative ones give every token the same logits
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"model config {name} must be a positive finite number, got {value!r}")
        bad_eos = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if bad_eos:
            raise ValueError(
                f"eos_token_id {bad_eos[0]} (config.json or generation_config.json) is outside the "
                f"vocabulary [0, {self.vocab_size}): generation could never stop on it; fix the id"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                    f"({self.num_experts})"
                )
            if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
                raise ValueError(
                    f"moe_intermediate_size ({self.moe_intermediate_size}) and decoder_sparse_step "
                    f"({self.decoder_sparse_step}) must be >= 1"
                )

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer index has a sparse MoE block (else a dense MLP of intermediate_size)."""
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Number of distinct weights (a tied lm_head counts once), computed from the shapes alone."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        moe = self.num_experts * (h + 3 * h * self.moe_intermediate_size)  # router + experts
        if self.mla is not None:
            attn = self.mla.attention_parameters(h, self.num_heads)
        if self.grouped_routing is not None:  # correction bias, shared experts
            shared = self.moe_intermediate_size * self.grouped_routing.n_shared_experts
            moe += self.num_experts + 3 * h * shared
        ffn = sum(moe if self.is_moe_layer(n) else 3 * h * i for n in range(self.num_layers))
        embed = self.vocab_size * h
        return self.num_layers * (attn + 2 * h) + ffn + embed + h + (0 if self.tie_word_embeddings else embed)

    @classmethod
    def from_hf_dict(
        cls, hf: dict, dtype: str = "auto", generation_config: dict | None = None, source: str = "config.json"
    ) -> ModelConfig:
        """Builds a ModelConfig from a config.json dict.

        dtype: the engine's --dtype ("auto" takes the checkpoint's torch_dtype/dtype, float32 when it
        names none). generation_config: generation_config.json's dict, whose eos ids are added.
        Raises ValueError naming the field and the fix for an unsupported architecture, dtype or shape.
        """
        architecture = _architecture(hf, source)
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag) and architecture != "Qwen2ForCausalLM":
                raise ValueError(
                    f"{source} sets {flag}: true, which tpfuse does not implement for {architecture} "
                    "(only Qwen2's q/k/v biases are supported)"
                )
        num_heads = _required(hf, "num_attention_heads", source)
        _check_count("num_attention_heads", num_heads, 1, source)
        hidden = _check_count("hidden_size", _required(hf, "hidden_size", source), 1, source)
        rope_params = dict(_object(hf, "rope_parameters", source))
        rope_scaling = _object(hf, "rope_scaling", source) or rope_params or None
        rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        if rope_scaling is not None:
            rope_scaling = {k: v for k, v in rope_scaling.items() if k != "rope_theta"}
            if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
                rope_scaling = None
        max_positions = hf.get("max_position_embeddings", 2048)
        window = hf.get("sliding_window")
        uses_window = hf.get("use_sliding_window", architecture in _SLIDING_WINDOW_ARCHITECTURES)
        if window and uses_window and window < max_positions:
            # Sliding-window attention is not implemented: within the window it equals full attention.
            max_positions = window
        fields = dict(
            architecture=architecture,
            hidden_size=hidden,
            num_layers=_required(hf, "num_hidden_layers", source),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            intermediate_size=_required(hf, "intermediate_size", source),
            vocab_size=_required(hf, "vocab_size", source),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=architecture == "Qwen2ForCausalLM",
            qk_norm=architecture in _QK_NORM_ARCHITECTURES,
            **_moe_fields(hf, architecture, source),
            dtype=resolve_dtype(hf.get("torch_dtype") or hf.get("dtype"), dtype, source),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids(hf, generation_config, source),
        )
        fields.update(_deepseek_fields(hf, architecture, source))
        try:
            return cls(**fields)
        except ValueError as e:  # the checks of __post_init__, which knows no file
            raise ValueError(f"{source}: {e}" if source not in str(e) else str(e)) from e


def resolve_dtype(checkpoint_dtype: str | None, override: str = "auto", source: str = "config.json"):
    """The run dtype: --dtype when given, else the checkpoint's, else float32. Raises ValueError."""
    if override != "auto":
        if override not in _DTYPES:
            raise ValueError(
                f"--dtype {override!r} is not supported; choose auto, float32, bfloat16 or float16"
            )
        return _DTYPES[override]
    if checkpoint_dtype is None:
        return torch.float32
    name = str(checkpoint_dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(
            f"{source} sets dtype {checkpoint_dtype!r}, which tpfuse does not run; "
            "pass --dtype bfloat16, float16 or float32"
        )
    return _DTYPES[name]


def _architecture(hf: dict, source: str) -> str:
    names = hf.get("architectures") or []
    if not (isinstance(names, list) and all(isinstance(name, str) for name in names)):
        raise ValueError(
            f'{source} architectures must be a list of class names, e.g. ["LlamaForCausalLM"]; got {names!r}'
        )
    if not names and hf.get("model_type") in _ARCHITECTURE_OF_MODEL_TYPE:
        names = [_ARCHITECTURE_OF_MODEL_TYPE[hf["model_type"]]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = ", ".join(names) or f"model_type {hf.get('model_type')!r}"
    raise ValueError(
        f"{source}: architecture {found} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _moe_fields(hf: dict, architecture: str, source: str) -> dict:
    """The mixture-of-experts fields of a config.json (Qwen3-MoE: num_experts, moe_intermediate_size;
    Mixtral: num_local_experts, experts of intermediate_size, always renormalised); {} when dense."""
    if architecture not in _MOE_ARCHITECTURES:
        return {}
    num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    if num_experts < 1:
        raise ValueError(f"{source} is a {architecture} config without num_experts / num_local_experts >= 1")
    mixtral = architecture == "MixtralForCausalLM"
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=hf.get("num_experts_per_tok", 2),
        moe_intermediate_size=hf.get("moe_intermediate_size") or hf.get("intermediate_size", 0),
        norm_topk_prob=True if mixtral else bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
        mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
    )


def _deepseek_fields(hf: dict, architecture: str, source: str) -> dict:
    """DeepseekV3ForCausalLM (and Kimi-K2): the MLA shape, routing, the common MoE fields from
    n_routed_experts, the first first_k_dense_replace layers dense, and head_dim = qk_rope_head_dim
    (the rotary cache's width); {} for other families."""
    if architecture != "DeepseekV3ForCausalLM":
        return {}
    routing = grouped_routing(hf, source)
    experts = hf.get("n_routed_experts") or 0
    if experts < 1:
        raise ValueError(f"{source} is a DeepseekV3ForCausalLM config without n_routed_experts >= 1")
    groups, kept = routing.n_group, routing.topk_group
    if groups < 1 or experts % groups or experts // groups < 2 or not 1 <= kept <= groups:
        raise ValueError(
            f"{source}: n_routed_experts ({experts}) must split into n_group ({groups}) groups of >= 2 "
            f"experts, with 1 <= topk_group ({kept}) <= n_group"
        )
    num_layers = _required(hf, "num_hidden_layers", source)
    return dict(
        mla=mla_shape(hf),
        grouped_routing=routing,
        head_dim=hf["qk_rope_head_dim"],
        num_experts=experts,
        num_experts_per_tok=_required(hf, "num_experts_per_tok", source),
        moe_intermediate_size=_required(hf, "moe_intermediate_size", source),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        mlp_only_layers=tuple(range(min(routing.first_k_dense_replace, num_layers))),
    )


def _check_count(name: str, value, low: int, source: str = "model config") -> int:
    """value, when it is an integer >= low (a count or size); else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{source} {name} must be an integer >= {low}, got {value!r}")
    return value


def _object(hf: dict, key: str, source: str) -> dict:
    """hf[key] when it is a JSON object ({} when absent or null); else ValueError naming it."""
    value = hf.get(key)
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{source} {key} must be an object (or null); got {value!r}")
    return value or {}


def _required(hf: dict, key: str, source: str):
    if key not in hf:
        raise ValueError(f"{source} has no {key!r}; is it a Llama-family config.json?")
    return hf[key]


def _token_ids(value, where: str) -> list[int]:
    """eos_token_id as JSON gives it (an id, a list of ids or null) -> its ids; anything else (a
    string, a float, a boolean) is refused naming where it was read."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(
                f"{where}: eos_token_id must be a token id or a list of them, got {v!r}; "
                f"write it as a number without quotes"
            )
    return values


def eos_ids(hf: dict, generation_config: dict | None, source: str) -> tuple[int, ...]:
    """The eos_token_id of config.json (hf, read from source) and generation_config.json beside it,
    in that order without repeats; ValueError naming the file for a value that is not a token id."""
    folder = os.path.dirname(source)
    ids = _token_ids(hf.get("eos_token_id"), source) + _token_ids(
        (generation_config or {}).get("eos_token_id"), os.path.join(folder, "generation_config.json")
    )
    return tuple(dict.fromkeys(ids))
