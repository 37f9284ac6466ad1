"""Rotary position embeddings (half-split layout, as Hugging Face Llama), with rope scaling."""

from __future__ import annotations

import math
from typing import Any

import torch

from qworker.model.config import UnsupportedModelError


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    if kind == "freq_factors":  # llama3 as llama.cpp stores it: each frequency's divisor
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float)
    raise UnsupportedModelError(f"unsupported rope scaling {kind!r} "
                                "(supported: linear, llama3, freq_factors)")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def llama3_divisors(head_dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3's scaling as llama.cpp's converter writes it into a GGUF (`rope_freqs.weight`):
    each frequency's divisor, which the loader reads back as `freq_factors`."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    dims = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    wavelen = 2 * math.pi * theta**dims
    smooth = (old_len / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    divisors = torch.where(wavelen > old_len / low, factor, blended)
    return torch.where(wavelen < old_len / high, 1.0, divisors).float()


class RotaryTable:
    """cos / sin for every position up to max_positions, computed in float32 then cast."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
        dtype: torch.dtype, device: torch.device | str,
    ) -> None:
        # on the target device, as the reference does: CPU and GPU cos/sin differ in the last bit
        inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
        positions = torch.arange(max_positions, dtype=torch.float, device=device)
        freqs = positions[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.cos = angles.cos().to(dtype)
        self.sin = angles.sin().to(dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the given positions, shaped [N, 1, head_dim] to broadcast over heads."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim] rotated by its tokens' (cos, sin) from `RotaryTable.lookup`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
