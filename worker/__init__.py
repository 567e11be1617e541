"""The worker process: one tensor-parallel rank holding a model shard, its KV cache, and the forward pass."""
