"""Loading a checkpoint: a Hugging Face safetensors folder or a GGUF file -> config + tensors.

Tensors come back under Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...) as the
family's declaration lays them out, checked against the shapes the config implies
(`tensors.validate`), so the model never sees a malformed checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qworker.model.config import ModelConfig
from qworker.model.loading.gguf_checkpoint import load_gguf
from qworker.model.loading.hf_folder import load_hf_folder
from qworker.model.loading.tensors import LoaderError, Weight


def load_checkpoint(path: str | Path,
                    keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, Weight]]:
    """Load a HF safetensors folder, a `.gguf` file, or a folder holding exactly one `.gguf`.
    With keep_quantized, a GGUF's block-quantized matrices come back as `QuantWeight`s (their
    blocks as stored); otherwise every tensor is dequantized."""
    path = Path(path)
    if not path.exists():
        raise LoaderError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise LoaderError(f"{path}: not a .gguf file (pass a GGUF file or a checkpoint folder)")
        return load_gguf(path, keep_quantized)
    if (path / "config.json").is_file():
        return dict_of_weights(load_hf_folder(path))
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return load_gguf(ggufs[0], keep_quantized)
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise LoaderError(f"{path}: holds {len(ggufs)} .gguf files ({names}); pass one of them")
    raise LoaderError(f"{path}: neither a config.json nor a .gguf file in this folder")


def dict_of_weights(loaded: tuple[ModelConfig, dict[str, torch.Tensor]]
                    ) -> tuple[ModelConfig, dict[str, Weight]]:
    return loaded[0], dict(loaded[1])
