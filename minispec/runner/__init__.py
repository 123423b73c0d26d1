"""Running a model over a batch of requests: the model runner and its KV cache (below spec_decode and engine)."""
