"""DeepSeek-V3's multi-token-prediction (MTP / NextN) module, model.layers.{num_hidden_layers}.* of the
checkpoint (config.json's num_nextn_predict_layers > 0), and loading it from the target's checkpoint.

Given the target's final hidden state h_t (after its final norm, as SGLang and vLLM feed it) at
position t and the token at t + 1, the module computes x = eh_proj([enorm(embed(tok_{t+1}));
hnorm(h_t)]), runs one DeepSeek-V3 decoder layer (MLA over its own latent cache, MoE or dense MLP as
the layer index says) and shared_head.norm; the normed state gives the logits of token t + 2 through
shared_head.head and is also the h fed to the next chained step. The embedding and head are the
module's own when the checkpoint carries them (embed_tokens, shared_head.head), else the target's.
Under TP the layer is sharded like the target's; eh_proj's output is replicated on every rank. In a
quantized checkpoint eh_proj takes the checkpoint's quantization only when scale tensors sit beside
its weight.
"""

from __future__ import annotations

import torch
from torch import nn

from tpfuse.config import EngineConfig
from tpfuse.model.attention import AttentionMetadata
from tpfuse.model.config import ModelConfig
from tpfuse.model.deepseek_v3 import DeepseekV3DecoderLayer
from tpfuse.model.layers import (
    ColumnParallelLinear,
    ParallelContext,
    ParallelLMHead,
    RMSNorm,
    ShardSlot,
    VocabParallelEmbedding,
)
from tpfuse.model.linear_method import UNQUANTIZED, method_for, module_prefix


class DeepseekV3MTP(nn.Module):
    """forward(input_embeds [T, H] full, hidden [T, H], positions [T], attn, kv_cache (latent_cache,),
    cos_sin_cache) -> normed [T, H]; compute_logits(normed) -> [T, vocab] float32 on every rank.
    prefix: the checkpoint prefix of the module ("model.layers.{num_hidden_layers}.")."""

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelContext,
        prefix: str,
        target: nn.Module,
        own_embedding: bool,
        own_head: bool,
        quantized_eh_proj: bool = True,
    ):
        super().__init__()
        h, eps, dtype = config.hidden_size, config.rms_norm_eps, config.dtype
        self.prefix, self.eps, self.comm = prefix, eps, parallel.comm
        self.layer_index = int(prefix.split(".")[2])
        self.own_embedding, self.own_head = own_embedding, own_head
        if own_embedding:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, parallel, dtype)
        else:
            self.__dict__["embed_tokens"] = target.embed_tokens  # shared, not a submodule
        self.enorm = RMSNorm(h, eps, dtype)
        self.hnorm = RMSNorm(h, eps, dtype)
        with module_prefix(prefix):  # the checkpoint's quantization, by name (ignore lists apply)
            method = method_for("column", ["eh_proj"]) if quantized_eh_proj else UNQUANTIZED
        self.eh_proj = ColumnParallelLinear(
            2 * h, [], parallel, dtype, part_ranges=[(h, 0, h)], method=method
        )
        self.layer = DeepseekV3DecoderLayer(config, parallel, self.layer_index)
        self.shared_head_norm = RMSNorm(h, eps, dtype)
        if own_head:
            self.head = ParallelLMHead(config.vocab_size, h, parallel, dtype)
        else:
            self.__dict__["head"] = target.lm_head

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[N] int64 -> [N, H] full embeddings on every rank (every rank must call it together)."""
        return self.comm.all_reduce(self.embed_tokens(token_ids))

    def forward(
        self,
        input_embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor],
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        layer, comm, eps = self.layer, self.comm, self.eps
        dtype = self.enorm.weight.dtype
        x = torch.cat([self.enorm(input_embeds.to(dtype)), self.hnorm(hidden.to(dtype))], dim=-1)
        x = self.eh_proj(x)
        partial = layer.self_attn(positions, layer.input_layernorm(x), attn, kv_cache, cos_sin_cache)
        h, residual = comm.fused_add_rmsnorm_all_reduce(
            partial, x, layer.post_attention_layernorm.weight, eps
        )
        normed, _ = layer.mlp.forward_add_rmsnorm(h, residual, self.shared_head_norm.weight, eps, comm)
        return normed

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.head(normed)

    def checkpoint_slots(self) -> dict[str, ShardSlot]:
        p = self.prefix
        slots = {
            p + "enorm.weight": self.enorm.slot(),
            p + "hnorm.weight": self.hnorm.slot(),
            p + "shared_head.norm.weight": self.shared_head_norm.slot(),
        }
        slots.update(self.eh_proj.checkpoint_slots([p + "eh_proj"]))
        slots.update(self.layer.checkpoint_slots(p))
        if self.own_embedding:
            slots[p + "embed_tokens.weight"] = self.embed_tokens.slot()
        if self.own_head:
            slots[p + "shared_head.head.weight"] = self.head.slot()
        return slots


def num_nextn_predict_layers(engine_config: EngineConfig) -> int:
    """config.json's num_nextn_predict_layers of --model (0 for presets, GGUF files, or when absent)."""
    import os

    from tpfuse.model.loader import read_json

    model = engine_config.model
    if not os.path.isdir(model):
        return 0
    return int((read_json(os.path.join(model, "config.json")) or {}).get("num_nextn_predict_layers") or 0)


def load_mtp_module(
    engine_config: EngineConfig,
    target: nn.Module,
    config: ModelConfig,
    parallel: ParallelContext,
    device: torch.device | str,
) -> DeepseekV3MTP:
    """Builds this rank's first MTP module of the target's checkpoint (--model) and fills its weights
    (seeded random ones for --load-format dummy). Raises CheckpointError (a ValueError) when the
    checkpoint declares or carries no MTP layer, or a tensor is missing or has the wrong shape."""
    from tpfuse.model.linear_method import linear_methods, process_all
    from tpfuse.model.loader import (
        CheckpointError,
        check_all_parameters_written,
        checkpoint_files,
        copy_tensors,
        fill_dummy_weights,
        load_quant_config,
    )
    from tpfuse.model.presets import is_preset

    if config.architecture != "DeepseekV3ForCausalLM" or config.mla is None:
        raise CheckpointError(
            f"--speculative-algorithm mtp needs a DeepseekV3ForCausalLM target with MTP layers; "
            f"--model {engine_config.model} is {config.architecture}"
        )
    prefix = f"model.layers.{config.num_layers}."
    dummy = is_preset(engine_config.model) or engine_config.load_format == "dummy"
    files = {} if dummy else checkpoint_files(engine_config.model)
    if not dummy and (
        num_nextn_predict_layers(engine_config) < 1 or not any(n.startswith(prefix) for n in files)
    ):
        raise CheckpointError(
            f"checkpoint {engine_config.model} has no MTP (NextN) layer: config.json's "
            f"num_nextn_predict_layers is {num_nextn_predict_layers(engine_config)} and no tensor is named "
            f"{prefix}*; use a checkpoint that ships its MTP weights (e.g. DeepSeek-V3's layer 61) or "
            "another --speculative-algorithm (eagle3, draft, ngram)"
        )
    own_embedding = dummy or prefix + "embed_tokens.weight" in files
    own_head = dummy or prefix + "shared_head.head.weight" in files
    # some exports keep eh_proj unquantized (no scale tensors beside its weight): load it as stored
    eh_proj = prefix + "eh_proj."
    eh_scaled = dummy or any(n.startswith(eh_proj) and n != eh_proj + "weight" for n in files)
    with torch.device(device), linear_methods(load_quant_config(engine_config)):
        module = DeepseekV3MTP(config, parallel, prefix, target, own_embedding, own_head, eh_scaled)
    slots = module.checkpoint_slots()
    if dummy:
        fill_dummy_weights(slots, engine_config.seed)
    else:
        missing = sorted(n for n in slots if n not in files)
        if missing:
            raise CheckpointError(
                f"checkpoint {engine_config.model}: the MTP layer {prefix}* lacks {len(missing)} tensor(s), "
                f"e.g. {', '.join(missing[:8])}; the checkpoint's MTP weights are incomplete"
            )
        copy_tensors(slots, files)
    check_all_parameters_written(module, slots)
    try:
        process_all(module)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {engine_config.model} (MTP layer): {e}") from e
    return module.eval()
