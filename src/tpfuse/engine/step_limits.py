"""The limits the engine sizes its buffers for: the most rows one captured step feeds the
projections, and the longest sequence (--max-model-len against the model's positions)."""

from __future__ import annotations

from tpfuse.config import EngineConfig


def max_step_rows(config: EngineConfig) -> int:
    """The most rows a captured decode or verify step feeds the projections: the largest graph batch
    times the query tokens per sequence (1 + drafts in a chain; a tree's num_draft_tokens, which
    count its root)."""
    per_seq = 1
    if config.speculative.enabled:
        per_seq = max(1 + config.speculative.num_steps, config.speculative.num_draft_tokens or 0)
    return min(config.cuda_graph_max_bs, config.max_running_requests) * per_seq


def resolve_max_model_len(config: EngineConfig, max_position_embeddings: int) -> int:
    """--max-model-len, or the model's max_position_embeddings; raises ValueError when the flag exceeds it."""
    if config.max_model_len is None:
        return max_position_embeddings
    if not 1 < config.max_model_len <= max_position_embeddings:
        raise ValueError(
            f"--max-model-len {config.max_model_len} must lie in [2, {max_position_embeddings}], the "
            "model's max_position_embeddings"
        )
    return config.max_model_len
