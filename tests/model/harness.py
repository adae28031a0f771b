"""Test harness for the model layer: tiny Hugging Face checkpoints, a paged KV cache with scattered
block tables, and AttentionMetadata for prefill, chunked-prefill and decode steps.

It stands in for the engine so the model can be checked against transformers on its own.
transformers is imported inside functions: spawned TP ranks import this module and need only torch.
"""

from __future__ import annotations

import random

import torch

from tpfuse.comm.communicator import SingleRankCommunicator
from tpfuse.config import EngineConfig
from tpfuse.model.attention import AttentionMetadata
from tpfuse.model.layers import ParallelContext
from tpfuse.model.loader import load_model

SMALL_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=253,  # divisible by neither 2 nor 4: the vocab-parallel padding is exercised
    max_position_embeddings=256,
)
ARCHITECTURE_VARIANTS = {
    "llama": dict(
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "qwen2": dict(),
    "qwen3": dict(head_dim=32),
    "mistral": dict(sliding_window=None),
}
# Mixture-of-experts checkpoints (tests/model/test_moe_models.py), kept out of ARCHITECTURE_VARIANTS so
# the dense suites do not grow. Expert counts are odd or equal to top-k (every token takes every expert).
MOE_VARIANTS = {
    "qwen3_moe": dict(  # layers 0 and 2 sparse, 1 dense (mlp_only_layers), renormalised top-2 of 5
        head_dim=32,
        num_hidden_layers=3,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=5,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    "qwen3_moe_step": dict(  # decoder_sparse_step 2: layer 1 sparse, and top-4 of 4 experts
        num_hidden_layers=2,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=4,
        norm_topk_prob=False,
        decoder_sparse_step=2,
    ),
    "mixtral": dict(num_hidden_layers=2, intermediate_size=32, num_local_experts=3, num_experts_per_tok=2),
}
_CONFIG_CLASS = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "mistral": "MistralConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "qwen3_moe_step": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
}


def build_hf_checkpoint(directory, kind: str, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Saves a random transformers model of architecture kind (a key of ARCHITECTURE_VARIANTS or
    MOE_VARIANTS) in float32 to directory (sharded when max_shard_size is given) and returns the model.
    MoE routers are drawn at std 0.5, so routing is decisive and no two experts tie by accident."""
    import transformers

    config_class = getattr(transformers, _CONFIG_CLASS[kind])
    variant = {**ARCHITECTURE_VARIANTS, **MOE_VARIANTS}[kind]
    config = config_class(**{**SMALL_SHAPE, **variant, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random init leaves biases and norms at 0/1; make every tensor matter
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("gate.weight"):
                param.copy_(torch.randn_like(param) * 0.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return model


def copy_without_tensor(directory, destination, name: str) -> None:
    """Writes the safetensors checkpoint at directory to destination (one file, the same config.json)
    without tensor name: a checkpoint that must fail to load, naming it."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    tensors = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(path))
    del tensors[name]
    save_file(tensors, Path(destination, "model.safetensors"), metadata={"format": "pt"})
    Path(destination, "config.json").write_text(Path(directory, "config.json").read_text())


def hf_logits(hf_model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers' float32 logits [len, vocab] for every position of every sequence, one at a time."""
    with torch.no_grad():
        return [hf_model(torch.tensor([s])).logits[0].float() for s in sequences]


def load_for_test(
    path, tp_rank: int = 0, tp_size: int = 1, comm=None, dtype="float32", device="cpu", **engine_kwargs
):
    """load_model for one rank (TP=1 with a SingleRankCommunicator by default)."""
    engine_config = EngineConfig(model=str(path), dtype=dtype, tp_size=tp_size, **engine_kwargs)
    parallel = ParallelContext(tp_rank, tp_size, comm or SingleRankCommunicator())
    return load_model(engine_config, parallel, device)


class PagedSequences:
    """Sequences in a paged KV cache whose blocks are handed out in shuffled order, so block tables
    are neither contiguous nor sorted. step() runs one forward pass over new tokens of every sequence."""

    def __init__(self, model, num_sequences: int, num_blocks: int = 64, block_size: int = 4, seed: int = 0):
        dtype, device = model.config.dtype, model.cos_sin_cache.device
        self.model = model
        self.device = device
        self.block_size = block_size
        if hasattr(model, "kv_cache_layout"):  # the layout the model declares (MLA: latent rows)
            self.kv_caches = model.kv_cache_layout(1).allocate(num_blocks, block_size, device)
        else:
            attn = model.layers[0].self_attn
            shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
            empty = lambda: torch.empty(shape, dtype=dtype, device=device)  # noqa: E731
            self.kv_caches = [(empty(), empty()) for _ in model.layers]
        for cache in (t for layer in self.kv_caches for t in layer):
            cache.fill_(float("nan"))  # unwritten slots must never be read
        self.num_blocks = num_blocks
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: list[list[int]] = [[] for _ in range(num_sequences)]
        self.lengths = [0] * num_sequences

    def metadata(self, new_lengths: list[int], is_decode: bool) -> tuple[AttentionMetadata, torch.Tensor]:
        """Allocates blocks for the new tokens; returns (AttentionMetadata, positions [T] int64)."""
        positions, slots = [], []
        for seq, n in enumerate(new_lengths):
            start = self.lengths[seq]
            while len(self.block_tables[seq]) * self.block_size < start + n:
                if not self.free_blocks:
                    raise RuntimeError(
                        f"PagedSequences ran out of KV blocks: {start + n} tokens of sequence {seq} need more"
                        f" than {self.num_blocks} blocks of {self.block_size}; pass a larger num_blocks"
                    )
                self.block_tables[seq].append(self.free_blocks.pop())
            for pos in range(start, start + n):
                positions.append(pos)
                block = self.block_tables[seq][pos // self.block_size]
                slots.append(block * self.block_size + pos % self.block_size)
            self.lengths[seq] = start + n
        width = max(len(t) for t in self.block_tables)
        tables = [t + [0] * (width - len(t)) for t in self.block_tables]
        starts = [0]
        for n in new_lengths:
            starts.append(starts[-1] + n)
        on_device = lambda values, dtype: torch.tensor(values, dtype=dtype, device=self.device)
        attn = AttentionMetadata(
            slot_mapping=on_device(slots, torch.int64),
            block_tables=on_device(tables, torch.int32),
            seq_lens=on_device(self.lengths, torch.int32),
            query_start_loc=on_device(starts, torch.int32),
            max_query_len=max(new_lengths),
            max_seq_len=max(self.lengths),
            is_decode=is_decode,
        )
        return attn, on_device(positions, torch.int64)

    def step(self, new_tokens: list[list[int]], is_decode: bool = False):
        """new_tokens: per sequence the tokens of this pass. Returns (logits [T, vocab] float32, aux)."""
        attn, positions = self.metadata([len(t) for t in new_tokens], is_decode)
        input_ids = torch.tensor(
            [t for toks in new_tokens for t in toks], dtype=torch.int64, device=self.device
        )
        with torch.no_grad():
            hidden, aux = self.model(input_ids, positions, attn, self.kv_caches)
            return self.model.compute_logits(hidden), aux


def run_prefill_then_decode(model, prompts: list[list[int]], decode_tokens: list[list[int]]):
    """Prefills every prompt in one pass, then one decode pass per decode_tokens[step] (a token per
    sequence). Returns the prefill logits [T, vocab] and a list of decode logits [B, vocab]."""
    seqs = PagedSequences(model, len(prompts))
    prefill, _ = seqs.step(prompts)
    decodes = [seqs.step([[t] for t in step], is_decode=True)[0] for step in decode_tokens]
    return prefill, decodes


def prefill_logits_on_routes(model, prompt: list[int], rows_route) -> torch.Tensor:
    """Prefill logits of one sequence with layer 0's projection shapes (every layer's of the same shape)
    on the Triton W8A8 prefill route, and the norm-reading ones (qkv, gate_up) taking FP8 rows on
    rows_route (None: the plain tensor); the choices are forgotten after (model/linear_choice.py)."""
    from tpfuse.kernels.fp8_scaled_mm import TRITON_PREFILL
    from tpfuse.model import linear_choice

    layer0 = model.layers[0]
    readers = (layer0.self_attn.qkv_proj, layer0.mlp.gate_up_proj)
    projections = (*readers, layer0.self_attn.o_proj, layer0.mlp.down_proj)
    for layer in projections:
        linear_choice.set_quant_tile(layer, len(prompt), TRITON_PREFILL)
    for layer in readers:
        linear_choice.set_form_route(layer, len(prompt), rows_route)
    try:
        return PagedSequences(model, 1, num_blocks=max(64, -(-len(prompt) // 4))).step([prompt])[0]
    finally:
        for layer in projections:
            linear_choice.set_quant_tile(layer, len(prompt), None)
            linear_choice.set_form_route(layer, len(prompt), None)


def decode_logits_on_half2x(model, prompt: list[int], decode_tokens: list[int], tile, on_form: bool):
    """Decode logits [len(decode_tokens), vocab] of one sequence (one row a step) after a plain prefill
    of prompt, with layer 0's INT4 projection shapes (every layer's of the same shape) on the f16x2
    GEMV at `tile`, and with on_form the ones that read a norm or SiLU-and-mul (qkv, gate_up, down)
    taking Half2X from them (model/input_forms.py); the choices are forgotten after."""
    from tpfuse.model import linear_choice

    layer0 = model.layers[0]
    readers = (layer0.self_attn.qkv_proj, layer0.mlp.gate_up_proj, layer0.mlp.down_proj)
    projections = (*readers, layer0.self_attn.o_proj)
    for layer in projections:
        linear_choice.set_quant_tile(layer, 1, tile)
    for layer in readers if on_form else ():
        linear_choice.set_form_route(layer, 1, tile)
    try:
        seqs = PagedSequences(model, 1, num_blocks=max(64, -(-(len(prompt) + len(decode_tokens)) // 4)))
        seqs.step([prompt])
        return torch.cat([seqs.step([[token]], is_decode=True)[0] for token in decode_tokens])
    finally:
        for layer in projections:
            linear_choice.set_quant_tile(layer, 1, None)
            linear_choice.set_form_route(layer, 1, None)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def greedy(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    """Prefill, then greedy decode steps; returns (tokens per prompt, the prefill logits)."""
    seqs = PagedSequences(model, len(prompts))
    logits, _ = seqs.step(prompts)
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    prefill = logits
    tokens = [[t] for t in logits[ends].argmax(-1).tolist()]
    for _ in range(new_tokens - 1):
        logits, _ = seqs.step([[t[-1]] for t in tokens], is_decode=True)
        for row, t in zip(tokens, logits.argmax(-1).tolist(), strict=True):
            row.append(t)
    return tokens, prefill


def hf_greedy_tokens(hf_model, prompts, new_tokens):
    """transformers' greedy continuation of each prompt, one at a time, without a KV cache."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(new_tokens):
                ids = torch.cat([ids, hf_model(ids).logits[:, -1:].argmax(-1)], dim=1)
            out.append(ids[0, len(p) :].tolist())
    return out


def greedy_on_rank(rank: int, world_size: int, directories: dict[str, str], prompts, new_tokens: int) -> dict:
    """run_distributed target: each checkpoint loaded on this rank over torch.distributed, then greedy;
    returns kind -> (tokens, prefill logits as numpy)."""
    from tpfuse.comm.communicator import TorchDistributedCommunicator

    torch.set_num_threads(1)
    comm = TorchDistributedCommunicator()
    results = {}
    for kind, directory in directories.items():
        model, _ = load_for_test(directory, tp_rank=rank, tp_size=world_size, comm=comm)
        tokens, prefill = greedy(model, prompts, new_tokens)
        results[kind] = (tokens, prefill.numpy())
    return results
