"""Benchmark harness: speaks HTTP to any OpenAI-compatible server."""
