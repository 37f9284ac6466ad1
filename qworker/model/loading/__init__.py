"""Checkpoints in: Hugging Face safetensors folders, GGUF files, known model names."""
