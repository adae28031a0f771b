"""tpfuse: tensor-parallel LLM inference with a fused all-reduce written in Triton."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import tpfuse` (and the CLI) does not import torch until the engine is used.
    if name == "LLM":
        from tpfuse.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tpfuse.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tpfuse' has no attribute {name!r}")
