"""Llama-family decoders (Llama 3, Qwen2, Qwen3, Mistral) with tensor-parallel layers, loaders and presets."""
