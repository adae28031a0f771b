"""Speculative decoding: drafters (EAGLE-3, n-gram, draft model), lossless verification, adaptive k."""
