"""Text to token ids and back: tokenizers from HF folders or GGUF metadata, chat templates."""
