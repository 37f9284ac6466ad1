"""Layers of a decoder: norms, attention over the paged cache, MLP, embedding, rotary tables."""
