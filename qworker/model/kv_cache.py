"""The paged KV cache: per layer, K and V of `kv_heads x num_blocks x block_size x head_dim`.

A block id names the same slot range in every layer of one KV group, so one block table serves
the group. A model has one group, or two where it has both full-attention and sliding-window
layers (Gemma 3, `KVLayout`): each group's layers hold blocks of their own pool, sized for what
the group keeps (a windowed group only the blocks its window sees, docs/engine.md). Heads lead
so that gathering a sequence's blocks yields `[kv_heads, tokens, head_dim]` directly, the layout
attention consumes, with no transposing copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qworker.model.config import ModelConfig


@dataclass(frozen=True)
class KVLayout:
    """Each layer's KV group, and each group's sliding window (None: full attention). One group
    where every layer attends alike (the longest window where every layer has one); else group
    0 the full-attention layers, group 1 the windowed ones (through the longest of their
    windows)."""

    layer_groups: tuple[int, ...]
    windows: tuple[int | None, ...]

    @classmethod
    def of(cls, config: ModelConfig) -> KVLayout:
        windowed = tuple(config.attention_of(i).window is not None
                         for i in range(config.num_layers))
        window = max(config.windows, default=None)
        if all(windowed) or not any(windowed):
            return cls((0,) * config.num_layers, (window,))
        return cls(tuple(int(w) for w in windowed), (None, window))

    def num_layers_of(self, group: int) -> int:
        return self.layer_groups.count(group)


@dataclass
class KVCache:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block_size: int
    # each layer's group (`KVLayout`) where they are two, each with its own block tables;
    # None: every layer reads the one block table (whatever its attention)
    layer_groups: tuple[int, ...] | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.keys[0].shape[1]) if self.layer_groups is None else self.blocks_of(0)

    @property
    def num_groups(self) -> int:
        return 1 if self.layer_groups is None else len(set(self.layer_groups))

    def blocks_of(self, group: int) -> int:
        """The blocks of a group's pool."""
        return int(self.keys[self.first_layer_of(group)].shape[1])

    def first_layer_of(self, group: int) -> int:
        return 0 if self.layer_groups is None else self.layer_groups.index(group)

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        window_blocks: int | None = None,
    ) -> KVCache:
        """`window_blocks`: the windowed layers' own pool, for a model of two groups; None:
        every layer in one pool of `num_blocks`."""
        groups = KVLayout.of(config).layer_groups if window_blocks is not None else None
        if groups is not None and len(set(groups)) == 1:
            groups = None  # one group: the pool is num_blocks
        keys, values = [], []
        for i in range(config.num_layers):
            windowed = groups is not None and groups[i] == 1 and window_blocks is not None
            blocks = window_blocks if windowed and window_blocks is not None else num_blocks
            shape = (config.num_kv_heads, blocks, block_size, config.head_dim)
            keys.append(torch.zeros(shape, dtype=dtype, device=device))
            values.append(torch.zeros(shape, dtype=dtype, device=device))
        return cls(keys, values, block_size, groups)


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype,
                    num_layers: int | None = None) -> int:
    """Memory one block takes across all layers (or `num_layers` of them), K and V."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    layers = config.num_layers if num_layers is None else num_layers
    return 2 * layers * block_size * config.num_kv_heads * config.head_dim * itemsize


def blocks_for_budget(
    config: ModelConfig, block_size: int, dtype: torch.dtype, gigabytes: float
) -> int:
    return max(1, int(gigabytes * 2**30) // bytes_per_block(config, block_size, dtype))
