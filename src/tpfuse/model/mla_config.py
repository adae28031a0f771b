"""The DeepSeek-V3 family's extra shape (also Kimi-K2's): multi-head latent attention and group-limited
routing, read from a config.json. Plain data: reading a config imports no model code."""

from __future__ import annotations

from dataclasses import dataclass

from tpfuse.kernels.rope import yarn_mscale


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention. q_lora_rank None: q is one projection of the hidden state."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    def __post_init__(self):
        sizes = (self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if min(sizes) < 1 or (self.q_lora_rank is not None and self.q_lora_rank < 1):
            raise ValueError(f"MLA sizes must be >= 1: {self}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim must be even for rotary embeddings, got {self.qk_rope_head_dim}"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def attention_parameters(self, hidden_size: int, num_heads: int) -> int:
        """Weights of one MLA layer: q (LoRA or one projection), kv_a, its norm, kv_b and o_proj."""
        q = num_heads * self.qk_head_dim
        if self.q_lora_rank is None:
            q_weights = hidden_size * q
        else:
            q_weights = hidden_size * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * q
        kv = hidden_size * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q_weights + kv + num_heads * self.v_head_dim * hidden_size

    def softmax_scale(self, rope_scaling: dict | None) -> float:
        """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2 when the rope is YaRN
        scaled with mscale_all_dim (DeepSeek-V3's attention-scale factor, as transformers applies it)."""
        scale = self.qk_head_dim**-0.5
        kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if kind != "default" and (rope_scaling or {}).get("mscale_all_dim"):
            scale *= yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"]) ** 2
        return scale


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek-V3's MoE beyond the common fields: sigmoid scores, e_score_correction_bias for the
    choice, n_group groups of which topk_group are kept, routed_scaling_factor on the weights, and
    n_shared_experts always-on experts (one MLP of n_shared_experts * moe_intermediate_size)."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float
    n_shared_experts: int
    first_k_dense_replace: int


def mla_shape(hf: dict) -> MLAShape:
    return MLAShape(
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )


def grouped_routing(hf: dict, source: str) -> GroupedRouting:
    scoring = hf.get("scoring_func", "sigmoid")
    topk_method = hf.get("topk_method", "noaux_tc")
    if scoring != "sigmoid" or topk_method != "noaux_tc":
        raise ValueError(
            f"{source}: only DeepSeek-V3 routing is supported (scoring_func 'sigmoid', topk_method "
            f"'noaux_tc'); got {scoring!r}, {topk_method!r}"
        )
    if hf.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"{source}: moe_layer_freq {hf['moe_layer_freq']} is not supported (only 1)")
    return GroupedRouting(
        n_group=hf.get("n_group") or 1,
        topk_group=hf.get("topk_group") or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_shared_experts=hf.get("n_shared_experts") or 0,
        first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
    )
