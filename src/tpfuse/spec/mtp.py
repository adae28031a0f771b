"""DeepSeek-V3's MTP (NextN) module as a drafter: the head contract eagle3_chain_draft drives.

The pairing is EAGLE-3's (spec/eagle3_drafter.py): the entry at position p reads the target's feature
at p (its final hidden state, after the final norm) and the token at p + 1, is stored in the module's
latent cache at p and predicts the token at p + 2; chained steps feed back the module's own normed
output. So MtpDrafter drafts with EAGLE-3's chain (eagle3_chain_draft: argmax chains, sampled drafts,
adaptive k = 0 catch-up); the vocabulary is the target's (to_target_ids is the identity). Graph-safe
window drafting and tree drafting are EAGLE-3 only.
"""

from __future__ import annotations

import torch
from torch import nn

from tpfuse.model.attention import AttentionMetadata
from tpfuse.model.deepseek_v3_mtp import DeepseekV3MTP
from tpfuse.spec.drafter import Drafter, DraftInputs, DraftProposal
from tpfuse.spec.eagle3_drafter import eagle3_chain_draft


class MtpHead(nn.Module):
    """module: this rank's DeepseekV3MTP; cos_sin_cache: the target's rotary cache (the MTP layer's
    attention uses the target's rope). feature_size / dtype: the feature store's row."""

    def __init__(self, module: DeepseekV3MTP, cos_sin_cache: torch.Tensor, vocab_size: int):
        super().__init__()
        self.module = module
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)
        self.vocab_size = vocab_size
        self.feature_size = module.enorm.weight.shape[0]
        self.dtype = module.enorm.weight.dtype
        self.embed_tokens = None  # the chain then uses the embedding it is given (module.embed)

    def combine_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """target_features: [T, H] the target's final hidden states; stored as they are."""
        return target_features.to(self.dtype)

    def forward(
        self,
        input_embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed [T, H] for compute_logits, the same [T, H] as the next step's hidden)."""
        normed = self.module(input_embeds, hidden, positions, attn, kv_cache, self.cos_sin_cache)
        return normed, normed

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.module.compute_logits(normed)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def target_ids_of_draft_vocab(self) -> torch.Tensor:
        return torch.arange(self.vocab_size, device=self.cos_sin_cache.device)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int]:
        """The module's one latent cache: [num_blocks, block_size, kv_lora_rank + rope_dim]."""
        shape = self.module.layer.self_attn.shape
        return (num_blocks, block_size, shape.kv_lora_rank + shape.qk_rope_head_dim)


class MtpDrafter(Drafter):
    """The MTP layer behind the Drafter interface. kv_cache: the module's one latent cache
    (MtpHead.kv_cache_shape), indexed by DraftInputs.block_tables."""

    def __init__(self, head: MtpHead, kv_cache: tuple[torch.Tensor], target_vocab_size: int):
        self.head = head
        self.embed_tokens = head.module.embed
        self.kv_cache = kv_cache
        self.target_vocab_size = target_vocab_size

    @torch.inference_mode()
    def propose(self, inputs: DraftInputs, num_draft_tokens: int) -> DraftProposal:
        return eagle3_chain_draft(
            self.head, self.embed_tokens, self.kv_cache, inputs, num_draft_tokens, self.target_vocab_size
        )
