"""The continuous-batching engine. Knows nothing of Redis."""
