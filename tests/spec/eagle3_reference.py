"""A dense float64 EAGLE-3 reference (no paged cache, full recompute) and paged-cache fixtures."""

import torch

from tpfuse.spec.drafter import DraftInputs


def _rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, positions, head_dim, theta):
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def dense_head_forward(head, embeds, hidden, positions):
    """One sequence, all entries at once with causal attention. Returns (normed, prenorm) float64."""
    c = head.config
    w = {n: p.double() for n, p in head.named_parameters()}
    eps, d = c.rms_norm_eps, c.head_dim
    e = _rmsnorm(embeds.double(), w["midlayer.input_layernorm.weight"], eps)
    residual = hidden.double()
    x = torch.cat([e, _rmsnorm(residual, w["midlayer.hidden_norm.weight"], eps)], dim=-1)
    n = x.shape[0]
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, c.num_heads, d)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, c.num_kv_heads, d)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, c.num_kv_heads, d)
    q, k = _rope(q, positions, d, c.rope_theta), _rope(k, positions, d, c.rope_theta)
    group = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    residual = residual + out @ w["midlayer.self_attn.o_proj.weight"].T
    h = _rmsnorm(residual, w["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = h @ w["midlayer.mlp.gate_proj.weight"].T, h @ w["midlayer.mlp.up_proj.weight"].T
    residual = residual + (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    return _rmsnorm(residual, w["norm.weight"], eps), residual


def dense_chain_draft(head, embedding, features, next_tokens, num_draft_tokens):
    """Greedy drafts for one sequence whose target features at positions 0..n-1 are features [n, F]
    and whose token after each position is next_tokens [n]. Returns target ids [k]."""
    hidden = features.double() @ head.fc.weight.double().T
    tokens = next_tokens.clone()
    drafts = []
    for _ in range(num_draft_tokens):
        positions = torch.arange(len(tokens))
        normed, prenorm = dense_head_forward(head, embedding[tokens].double(), hidden, positions)
        draft = int((normed[-1] @ head.lm_head.weight.double().T).argmax())
        target_id = draft + int(head.d2t[draft])
        drafts.append(target_id)
        tokens = torch.cat([tokens, torch.tensor([target_id])])
        hidden = torch.cat([hidden, prenorm[-1:]])
    return drafts


class PagedSequences:
    """Block tables that scatter each sequence over non-contiguous blocks of one shared pool."""

    def __init__(self, num_seqs, max_len, block_size=4, seed=0, device="cpu", dtype=torch.float32):
        self.block_size, self.device, self.dtype = block_size, device, dtype
        per_seq = -(-max_len // block_size)
        order = torch.randperm(num_seqs * per_seq, generator=torch.Generator().manual_seed(seed))
        self.block_tables = order.view(num_seqs, per_seq).to(device=device, dtype=torch.int32)
        self.num_blocks = num_seqs * per_seq

    def kv_cache(self, shape_fn):
        shape = shape_fn(self.num_blocks, self.block_size)
        return torch.zeros(shape, device=self.device, dtype=self.dtype), torch.zeros(
            shape, device=self.device, dtype=self.dtype
        )

    def inputs(self, starts, features, next_tokens, **extra):
        """DraftInputs for sequences whose verified positions are starts[b] .. starts[b]+len-1;
        features and next_tokens are lists (one tensor per sequence)."""
        lengths = [len(t) for t in next_tokens]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
        loc = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        extra = {k: v.to(self.device) for k, v in extra.items()}
        return DraftInputs(
            input_ids=torch.zeros_like(positions).to(self.device),
            positions=positions.to(self.device),
            next_token_ids=torch.cat(next_tokens).to(self.device),
            query_start_loc=loc.to(self.device),
            block_tables=self.block_tables,
            block_size=self.block_size,
            target_features=torch.cat(features).to(self.device, self.dtype),
            **extra,
        )
