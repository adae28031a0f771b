"""EAGLE-3 draft head in the public format (`LlamaForCausalLMEagle3`): its config and its module.

The head is one decoder layer that reads the target's features. Its first step maps the target's
residual stream at a few layers' inputs, concatenated ([T, n * H_target]), to H with `fc`; every
step then runs `midlayer`, whose q/k/v projections take [input_layernorm(embed(token)) ;
hidden_norm(h)] (width 2H), over the head's own paged KV cache, and returns (norm(h), h): the normed
state feeds `lm_head` over the draft vocabulary, the pre-norm state is fed back as the next step's
h. A draft id i is target id i + d2t[i]. Weights are replicated on every TP rank (the head is small).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpfuse.kernels import (
    fused_add_rmsnorm,
    rope_cos_sin_cache,
)
from tpfuse.model.attention import AttentionMetadata, paged_attention
from tpfuse.model.config import ModelConfig, resolve_dtype
from tpfuse.model.layers import Linear, RMSNorm
from tpfuse.model.llama import default_eagle3_aux_layers

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(slots=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    aux_layer_ids: tuple[int, ...] | None = None  # target layers whose inputs are read; None: default
    norm_before_residual: bool = False
    dtype: torch.dtype = torch.float32

    @classmethod
    def from_hf_dict(cls, hf: dict, dtype: str = "auto", source: str = "config.json") -> Eagle3Config:
        """Parses an EAGLE-3 head's config.json. Raises ValueError naming the field and the fix."""
        names = hf.get("architectures") or []
        if not any(name in EAGLE3_ARCHITECTURES for name in names):
            raise ValueError(
                f"{source}: architectures {names} name no EAGLE-3 head; expected one of "
                f"{', '.join(EAGLE3_ARCHITECTURES)} (is --speculative-draft-model-path an EAGLE-3 head?)"
            )
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
            if key not in hf:
                raise ValueError(f"{source} has no {key!r}; an EAGLE-3 head config needs it")
        if hf.get("num_hidden_layers", 1) != 1:
            raise ValueError(
                f"{source}: num_hidden_layers is {hf['num_hidden_layers']}; only single-layer EAGLE-3 "
                "heads (num_hidden_layers 1) are supported"
            )
        rope_params = dict(hf.get("rope_parameters") or {})
        rope_scaling = hf.get("rope_scaling") or rope_params or None
        if rope_scaling is not None:
            rope_scaling = {k: v for k, v in rope_scaling.items() if k != "rope_theta"}
            if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
                rope_scaling = None
        eagle = hf.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids", hf.get("eagle_aux_hidden_state_layer_ids"))
        heads = hf["num_attention_heads"]
        return cls(
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            vocab_size=hf["vocab_size"],
            draft_vocab_size=hf.get("draft_vocab_size") or hf["vocab_size"],
            target_hidden_size=hf.get("target_hidden_size") or hf["hidden_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
            norm_before_residual=bool(hf.get("norm_before_residual", False)),
            dtype=resolve_dtype(hf.get("torch_dtype") or hf.get("dtype"), dtype, source),
        )

    def capture_layers(self, target_num_layers: int) -> tuple[int, ...]:
        """Target layers whose inputs (residual stream) the head reads: the config's ids, else
        (2, N // 2, N - 3). Set them as the target's `aux_hidden_state_layers`."""
        return self.aux_layer_ids or default_eagle3_aux_layers(target_num_layers)

    def check_target(self, target: ModelConfig, source: str = "EAGLE-3 head") -> None:
        """Raises ValueError when the head was not made for this target (vocabulary, hidden size,
        layer ids)."""
        if self.vocab_size != target.vocab_size:
            raise ValueError(
                f"{source} has vocab_size {self.vocab_size} but the target model has {target.vocab_size}; "
                "use a head trained for this target"
            )
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"{source} expects target hidden size {self.target_hidden_size} but the target model has "
                f"{target.hidden_size}; use a head trained for this target"
            )
        layers = self.capture_layers(target.num_layers)
        if any(not 0 <= i < target.num_layers for i in layers):
            raise ValueError(
                f"{source} reads target layers {list(layers)} but the target has {target.num_layers} "
                "layers; use a head trained for this target"
            )


def _linear(in_features: int, out_features: int, dtype: torch.dtype) -> Linear:
    """An nn.Linear whose forward takes the measured route (layers.Linear: GEMV, few-row tile or cuBLAS)."""
    # skip_init builds on the meta device and then materializes on `device` (default cpu), ignoring a
    # surrounding `with torch.device(...)`; name the current default device explicitly.
    device = torch.get_default_device()
    return nn.utils.skip_init(Linear, in_features, out_features, bias=False, dtype=dtype, device=device)


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, d, dtype = config.hidden_size, config.head_dim, config.dtype
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.scale = d**-0.5
        self.q_proj = _linear(2 * h, config.num_heads * d, dtype)
        self.k_proj = _linear(2 * h, config.num_kv_heads * d, dtype)
        self.v_proj = _linear(2 * h, config.num_kv_heads * d, dtype)
        self.o_proj = _linear(config.num_heads * d, h, dtype)

    def forward(self, positions, x, attn: AttentionMetadata, kv_cache, cos_sin_cache) -> torch.Tensor:
        """x: [T, 2H] -> [T, H]; K/V of the T tokens are written into kv_cache at attn.slot_mapping."""
        t, d = x.shape[0], self.head_dim
        q = self.q_proj(x).view(t, self.num_heads, d)
        k = self.k_proj(x).view(t, self.num_kv_heads, d)
        v = self.v_proj(x).view(t, self.num_kv_heads, d)
        out = paged_attention(positions, q, k, v, kv_cache, cos_sin_cache, attn, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * d))


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, i, dtype = config.hidden_size, config.intermediate_size, config.dtype
        self.gate_proj, self.up_proj, self.down_proj = (
            _linear(h, i, dtype),
            _linear(h, i, dtype),
            _linear(i, h, dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Midlayer(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        h, eps, dtype = config.hidden_size, config.rms_norm_eps, config.dtype
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.hidden_norm = RMSNorm(h, eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        self.self_attn = Eagle3Attention(config)
        self.mlp = Eagle3MLP(config)


class Eagle3Head(nn.Module):
    """Parameter and buffer names are the public checkpoint's (fc, midlayer.*, norm, lm_head, d2t).

    max_positions: size of the rotary cache, at least the target's context length.
    """

    def __init__(self, config: Eagle3Config, max_positions: int | None = None):
        super().__init__()
        self.config = config
        h, dtype = config.hidden_size, config.dtype
        n_features = len(config.aux_layer_ids or (0, 0, 0))
        self.fc = _linear(n_features * config.target_hidden_size, h, dtype)
        self.midlayer = Eagle3Midlayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype)
        self.lm_head = _linear(h, config.draft_vocab_size, dtype)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.embed_tokens: nn.Embedding | None = None  # set only when the checkpoint ships its own
        positions = max(config.max_position_embeddings, max_positions or 0)
        cache = rope_cos_sin_cache(config.head_dim, positions, config.rope_theta, config.rope_scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def combine_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """target_features: [T, n * H_target] (the target's aux output) -> [T, H] via fc."""
        return self.fc(target_features.to(self.fc.weight.dtype))

    def forward(
        self,
        input_embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_embeds: [T, H] embeddings of the tokens; hidden: [T, H] (combine_features at the
        first step, the previous step's pre-norm output after); positions: [T] int64; kv_cache: the
        head's (k, v), each [num_blocks, block_size, num_kv_heads, head_dim], written at
        attn.slot_mapping. Returns (normed [T, H] for compute_logits, pre-norm [T, H] to feed back)."""
        m, eps = self.midlayer, self.config.rms_norm_eps
        embeds = m.input_layernorm(input_embeds.to(hidden.dtype))
        if self.config.norm_before_residual:
            hidden = residual = m.hidden_norm(hidden)
        else:
            residual, hidden = hidden, m.hidden_norm(hidden)
        x = torch.cat([embeds, hidden], dim=-1)
        out = m.self_attn(positions, x, attn, kv_cache, self.cos_sin_cache)
        h, residual = fused_add_rmsnorm(out, residual, m.post_attention_layernorm.weight, eps)
        return fused_add_rmsnorm(m.mlp(h), residual, self.norm.weight, eps)

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed: [N, H] -> [N, draft_vocab_size] float32 logits over the draft vocabulary."""
        return self.lm_head(normed).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target-vocabulary ids (id + d2t[id])."""
        return draft_ids + self.d2t[draft_ids]

    def target_ids_of_draft_vocab(self) -> torch.Tensor:
        """[draft_vocab_size] int64: the target id of every draft id."""
        return self.to_target_ids(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of each of the head's K and V caches for num_blocks blocks."""
        return (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
