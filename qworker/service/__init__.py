"""The Redis service around the engine. Knows nothing of tensors."""
