"""The engine: sequences, paged KV blocks, the scheduler, the model runner, workers and sampling."""
