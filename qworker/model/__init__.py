"""The model layer: decoders of several families over a paged KV cache (rooms: arch/, layers/,
loading/, kernels/, tokenizer/; docs/architecture.md). Knows nothing of scheduling."""
