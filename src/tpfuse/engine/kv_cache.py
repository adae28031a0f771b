"""KV cache sizing and allocation: how many paged blocks fit (after a warm-up at peak load shows the
activation peak), and the per-layer tensors of the layout the model declares (model/kv_layout.py;
GQA (k, v) pairs unless the model says otherwise)."""

from __future__ import annotations

import os

import torch

from tpfuse.kernels import sample
from tpfuse.model.attention import AttentionMetadata
from tpfuse.model.config import ModelConfig
from tpfuse.model.kv_layout import GQACacheLayout, KVCacheLayout

CPU_KV_BUDGET_BYTES = 64 * 2**20  # what a CPU engine takes at least
CPU_KV_MEMORY_SHARE = 0.125  # of the memory available at start-up, the most a CPU engine takes beyond that
CUDA_CONTEXT_BYTES = 2**30


def num_kv_heads_local(model_config: ModelConfig, tp_size: int) -> int:
    """KV heads one rank holds: split evenly, or one (replicated) when there are fewer heads than ranks."""
    return model_config.num_kv_heads // tp_size if model_config.num_kv_heads >= tp_size else 1


def gqa_layout(model_config: ModelConfig, tp_size: int) -> GQACacheLayout:
    """(k, v) per layer with this rank's KV heads."""
    return GQACacheLayout(
        model_config.num_layers,
        num_kv_heads_local(model_config, tp_size),
        model_config.head_dim,
        model_config.dtype,
    )


def cache_layout(model, model_config: ModelConfig, tp_size: int) -> KVCacheLayout:
    """The layout model declares (`model.kv_cache_layout(tp_size)`), else GQA pairs of its config."""
    declare = getattr(model, "kv_cache_layout", None)
    return declare(tp_size) if declare is not None else gqa_layout(model_config, tp_size)


def bytes_per_block(model_config: ModelConfig, tp_size: int, block_size: int) -> int:
    """K and V of every layer for block_size tokens on one rank (GQA layout)."""
    return gqa_layout(model_config, tp_size).bytes_per_block(block_size)


def cuda_kv_blocks(
    device: torch.device, block_bytes: int, mem_fraction_static: float, ranks_on_device: int = 1
) -> int:
    """Blocks that fit in this rank's share of the GPU after the weights and a warm-up forward.

    Call after the warm-up at the largest batch: its activation peak beyond what is allocated now is
    kept free. ranks_on_device > 1 (ranks sharing a GPU) splits the fraction between them.
    Raises RuntimeError when nothing is left, naming the flags that help.
    """
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    peak = torch.cuda.max_memory_allocated(device)
    if ranks_on_device == 1:
        budget = total * mem_fraction_static - used - (peak - torch.cuda.memory_allocated(device))
    else:
        # Other ranks load concurrently, so device-wide usage is a moving target: count only our own
        # peak plus a CUDA-context allowance against an even share.
        budget = total * mem_fraction_static / ranks_on_device - peak - CUDA_CONTEXT_BYTES
    blocks = int(budget // block_bytes)
    if blocks < 1:
        raise RuntimeError(
            f"no GPU memory left for the KV cache: {used / 2**30:.1f} GiB of {total / 2**30:.1f} GiB in use "
            f"after loading the model; raise --mem-fraction-static ({mem_fraction_static}), lower "
            "--max-num-batched-tokens, or use more GPUs (--tp-size)"
        )
    return blocks


def cpu_kv_blocks(block_bytes: int, longest_blocks: int, available_bytes: int | None = None) -> int:
    """Blocks on a CPU: enough for one sequence of the model's whole length (longest_blocks) where that
    fits in CPU_KV_MEMORY_SHARE of the available memory, and never fewer than CPU_KV_BUDGET_BYTES
    holds. --num-kv-blocks overrides both."""
    floor = max(1, CPU_KV_BUDGET_BYTES // block_bytes)
    available = available_memory_bytes() if available_bytes is None else available_bytes
    ceiling = int(available * CPU_KV_MEMORY_SHARE) // block_bytes
    return max(floor, min(longest_blocks, ceiling))


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the free physical pages; 0 where neither is known."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def allocate_kv_caches(
    model_config: ModelConfig, tp_size: int, num_blocks: int, block_size: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, kv_heads_local, head_dim], zeroed
    (masked-out lanes of attention kernels may still read stale slots: they must not hold NaN)."""
    return gqa_layout(model_config, tp_size).allocate(num_blocks, block_size, device)


@torch.inference_mode()
def warm_up_at_peak_load(model, kv_layout: KVCacheLayout, cfg, max_model_len: int, device) -> None:
    """CUDA: a forward over max_num_batched_tokens tokens (and sampling of the largest batch) so the
    activation peak is known before the KV cache takes the rest. K/V are not stored (slot -1)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)  # earlier engines in this process do not count
    num_tokens = min(cfg.max_num_batched_tokens, cfg.max_running_requests * max_model_len)
    seq_len = min(num_tokens, max_model_len)
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    dev = dict(device=device)
    caches = kv_layout.allocate(1, cfg.block_size, device)
    starts = torch.tensor([0, *lens], **dev).cumsum(0).to(torch.int32)
    attn = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, **dev),
        block_tables=torch.zeros(len(lens), -(-seq_len // cfg.block_size), dtype=torch.int32, **dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, **dev),
        query_start_loc=starts,
        max_query_len=seq_len,
        max_seq_len=seq_len,
        is_decode=False,
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, **dev)
    positions = torch.cat([torch.arange(n, **dev) for n in lens])
    hidden, _ = model(ids, positions, attn, caches)
    rows = min(num_tokens, cfg.max_running_requests)
    logits = model.compute_logits(hidden[:rows])
    ones = torch.ones(rows, **dev)
    sample(logits, ones, torch.full((rows,), 50, **dev), ones * 0.9, torch.arange(rows, **dev))
    del hidden, logits, caches
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
