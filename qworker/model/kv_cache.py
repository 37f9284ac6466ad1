"""The paged KV cache: per layer, K and V of `kv_heads x num_blocks x block_size x head_dim`.

A block id names the same slot range in every layer, so one block table serves the whole model.
Heads lead so that gathering a sequence's blocks yields `[kv_heads, tokens, head_dim]` directly,
the layout attention consumes, with no transposing copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qworker.model.config import ModelConfig


@dataclass
class KVCache:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return int(self.keys[0].shape[1])

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        shape = (config.num_kv_heads, num_blocks, block_size, config.head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        return cls(keys, values, block_size)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Memory one block takes across all layers, K and V."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize


def blocks_for_budget(
    config: ModelConfig, block_size: int, dtype: torch.dtype, gigabytes: float
) -> int:
    return max(1, int(gigabytes * 2**30) // bytes_per_block(config, block_size, dtype))
