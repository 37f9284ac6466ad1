"""The native decode-attention kernel equals the torch path it replaces, in every dtype it takes."""

from __future__ import annotations

import shutil

import pytest
import torch

from qworker.model import native
from qworker.model.attention import DecodePlan, _decode
from qworker.model.batch import DecodeGroup

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def test_the_kernel_builds_where_a_compiler_is() -> None:
    assert shutil.which("g++"), "the test machine has a C++ compiler"
    assert native.library() is not None


def _torch_plan(group: DecodeGroup, cache: torch.Tensor) -> DecodePlan:
    kv_heads, num_blocks, block_size, _ = cache.shape
    rows = (torch.arange(kv_heads)[:, None] * num_blocks + group.block_tables.flatten()).flatten()
    width = group.block_tables.shape[1] * block_size
    hidden = torch.arange(width)[None, :] >= group.context_lens[:, None]
    score_dtype = torch.promote_types(cache.dtype, torch.float32)
    bias = torch.zeros(hidden.shape, dtype=score_dtype).masked_fill_(hidden, float("-inf"))
    return DecodePlan(group, rows, bias[None, :, None])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [
    (9, 3, 64, 16),   # SmolLM2: vectorised path
    (8, 2, 128, 16),  # Llama-style head size
    (4, 4, 64, 8),    # no grouping, small blocks
    (6, 2, 48, 32),   # a head size the vector path does not take
])
def test_kernel_matches_the_torch_path(dtype: torch.dtype, heads: int, kv_heads: int,
                                       head_dim: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(heads * head_dim + block_size)
    lens = torch.tensor([1, 2, 15, 16, 17, 33, 64, 100, 257])
    width = int(-(-lens.max() // block_size))
    num_blocks = len(lens) * width + 1
    cache_k = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    cache_v = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks - 1, generator=gen)[: len(lens) * width] + 1
    # q as the model slices it out of q|k: rows strided, heads packed
    qk = torch.randn(len(lens), heads + kv_heads, head_dim, generator=gen).to(dtype)
    group = DecodeGroup(slice(0, len(lens)), tables.view(len(lens), width), lens)
    scale = head_dim**-0.5

    got = native.decode_attention(qk[:, :heads], cache_k, cache_v, group.block_tables, lens, scale)
    want = _decode(qk[:, :heads], cache_k, cache_v, _torch_plan(group, cache_k), scale)

    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_only_cpu_caches_of_known_dtypes_are_served() -> None:
    assert native.serves(torch.zeros(1, 1, 16, 8, dtype=torch.bfloat16))
    assert not native.serves(torch.zeros(1, 1, 16, 8, dtype=torch.float16))
    assert not native.serves(torch.zeros(1, 1, 16, 8, device="meta"))
