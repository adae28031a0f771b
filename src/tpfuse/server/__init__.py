"""OpenAI-compatible HTTP server, in its own process, talking to the engine process."""
