"""The model layer: a Llama-family decoder over a paged KV cache. Knows nothing of scheduling."""
