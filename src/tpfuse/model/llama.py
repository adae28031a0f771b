"""Llama-family decoders (Llama 3, Qwen2, Qwen3, Mistral): attention and a gated MLP in every layer.

Qwen2's q/k/v biases, Qwen3's q/k norms and Mistral's window are config values (model/config.py);
the forward loop and checkpoint names are DecoderForCausalLM's (model/decoder.py).
"""

from __future__ import annotations

from tpfuse.model.blocks import DecoderLayer, GatedMLP
from tpfuse.model.config import ModelConfig
from tpfuse.model.decoder import DecoderForCausalLM
from tpfuse.model.layers import ParallelContext


def default_eagle3_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The layers whose inputs EAGLE-3 heads read by default: (2, N // 2, N - 3)."""
    return (2, num_layers // 2, num_layers - 3)


class LlamaForCausalLM(DecoderForCausalLM):
    def make_layer(self, config: ModelConfig, parallel: ParallelContext, index: int) -> DecoderLayer:
        return DecoderLayer(
            config,
            parallel,
            lambda: GatedMLP(config.hidden_size, config.intermediate_size, parallel, config.dtype),
        )
