"""The native kernels equal the torch paths they replace, in every dtype they take."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from qworker.model.batch import DecodeGroup
from qworker.model.decoder import RMSNorm
from qworker.model.kernels import native
from qworker.model.kernels import native_build as nb
from qworker.model.layers.paged_attention import DecodePlan, _decode, write_kv
from qworker.model.layers.rope import RotaryTable, rotate
from tests.engine_fixtures import tiny_model
from tests.model_harness import run_schedule

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def test_the_kernel_builds_where_a_compiler_is() -> None:
    assert shutil.which("g++"), "the test machine has a C++ compiler"
    assert native.library() is not None


def _torch_plan(group: DecodeGroup, cache: torch.Tensor, window: int | None = None) -> DecodePlan:
    kv_heads, num_blocks, block_size, _ = cache.shape
    rows = (torch.arange(kv_heads)[:, None] * num_blocks + group.block_tables.flatten()).flatten()
    width = group.block_tables.shape[1] * block_size
    hidden = torch.arange(width)[None, :] >= group.context_lens[:, None]
    if window is not None:  # and what lies before each row's window
        hidden |= torch.arange(width)[None, :] < group.context_lens[:, None] - window
    score_dtype = torch.promote_types(cache.dtype, torch.float32)
    bias = torch.zeros(hidden.shape, dtype=score_dtype).masked_fill_(hidden, float("-inf"))
    return DecodePlan(group, rows, bias[None, :, None])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [
    (9, 3, 64, 16),   # SmolLM2: vectorised path
    (8, 2, 128, 16),  # Llama-style head size
    (4, 4, 64, 8),    # no grouping, small blocks
    (6, 2, 48, 32),   # a head size the vector path does not take
    (9, 3, 64, 128),  # the CPU's default block: runs of 16 rows, then the rest
    (16, 1, 64, 48),  # AMX: a whole tile of query heads; 32-token runs across blocks
    (8, 2, 128, 32),  # AMX: four 32-dimension slices of keys
])
@pytest.mark.parametrize("window", [None, 20])
def test_kernel_matches_the_torch_path(dtype: torch.dtype, heads: int, kv_heads: int,
                                       head_dim: int, block_size: int, window: int | None) -> None:
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

    got = native.decode_attention(qk[:, :heads], cache_k, cache_v, group.block_tables, lens, scale,
                                  window)
    want = _decode(qk[:, :heads], cache_k, cache_v, _torch_plan(group, cache_k, window), scale)

    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_amx_attention_serves_the_shapes_above_where_amx_is() -> None:
    if not native.amx_ready():
        pytest.skip(f"no AMX here ({native.status().level} build on {nb.cpu_model()}): the "
                    "bfloat16 cases above ran the vector kernels; absent hardware")
    for group, head_dim, block_size in ((3, 64, 16), (4, 128, 16), (3, 64, 128), (16, 64, 48),
                                        (4, 128, 32)):
        assert native.amx_attention_serves(group, head_dim, block_size)
    assert not native.amx_attention_serves(1, 64, 8)  # blocks of 8: the vector kernels
    assert not native.amx_attention_serves(3, 48, 32)  # a head size off the tiles
    assert not native.amx_attention_serves(17, 64, 16)  # more heads than a tile's columns


def test_only_cpu_caches_of_known_dtypes_are_served() -> None:
    assert native.serves(torch.zeros(1, 1, 16, 8, dtype=torch.bfloat16))
    assert not native.serves(torch.zeros(1, 1, 16, 8, dtype=torch.float16))
    assert not native.serves(torch.zeros(1, 1, 16, 8, device="meta"))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # one bfloat16 rounding apart at most: the kernels round once where torch rounds twice
    tol = TOLERANCE[got.dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(dtype: torch.dtype, with_delta: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(70, 96, generator=gen) * 3).to(dtype)
    delta = torch.randn(70, 96, generator=gen).to(dtype) if with_delta else None
    norm = RMSNorm(96, 1e-5).to(dtype).requires_grad_(False)
    norm.weight.copy_(torch.rand(96, generator=gen) + 0.5)
    want_x = x + delta if delta is not None else x.clone()
    want = norm(want_x)

    got = native.add_rms_norm(x, delta, norm.weight, norm.eps)

    torch.testing.assert_close(x, want_x, atol=0, rtol=0)  # the residual add is exact
    _close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim, num_blocks, block_size = 6, 2, 32, 9, 4
    n = 13
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 500, (n,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    rope = RotaryTable(head_dim, 512, 10000.0, None, dtype, "cpu")
    shape = (kv_heads, num_blocks, block_size, head_dim)
    want_k, want_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    qk, v = qkv.split(((heads + kv_heads) * head_dim, kv_heads * head_dim), dim=-1)
    want_qk = rotate(qk.reshape(n, heads + kv_heads, head_dim), *rope.lookup(positions))
    write_kv(want_k, want_v, want_qk[:, heads:], v.reshape(n, kv_heads, head_dim), slots)
    got_k, got_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)

    native.rope_store(qkv, rope.cos, rope.sin, positions, slots, got_k, got_v, heads)

    _close(qkv[:, : (heads + kv_heads) * head_dim].view(n, -1, head_dim), want_qk)
    _close(got_k, want_k)
    torch.testing.assert_close(got_v, want_v, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(33, 2 * 80, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0])  # exp overflow must not leak NaN
    gate, up = gate_up.chunk(2, dim=-1)

    got = native.silu_mul(gate_up)

    assert torch.isfinite(got).all()
    _close(got, F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(33, 2 * 80, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0])  # tanh saturates, no NaN
    gate, up = gate_up.chunk(2, dim=-1)

    got = native.gelu_tanh_mul(gate_up)

    assert torch.isfinite(got).all()
    _close(got, F.gelu(gate, approximate="tanh") * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_gives_the_same_logits_with_and_without_the_kernels(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model(vocab_size=120, dtype=dtype, seed=4)
    rng = random.Random(5)
    sequences = [[rng.randrange(120) for _ in range(n)] for n in (40, 28, 9)]
    # first and continued prefill chunks beside a decode, then decodes alone
    schedule = [[(0, 20), (1, 23)], [(0, 20), (2, 5), (1, 1)]]
    schedule += [[(1, 1), (2, 1)] for _ in range(4)]
    fused = run_schedule(model, sequences, schedule, block_size=4)
    monkeypatch.setattr(native, "serves", lambda cache: False)
    plain = run_schedule(model, sequences, schedule, block_size=4)

    assert len(fused) == len(plain) == 13
    for (seq, pos, got), (_, _, want) in zip(fused, plain, strict=True):
        tol = 1e-4 if dtype == torch.float32 else 0.15  # bf16 logits: a few roundings apart
        assert (got - want).abs().max() < tol, f"seq {seq} pos {pos}"


def test_loading_the_kernels_keeps_subnormal_floats() -> None:
    # a library linked with -ffast-math would set flush-to-zero for the whole process at load
    assert native.library() is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # subnormal in float32
    assert (tiny * 1.0).item() != 0.0
    assert float.fromhex("0x1p-1070") * 1.0 != 0.0  # and in Python's own doubles


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_cached", "num", "block_size"), [
    (0, 1, 16), (0, 37, 16), (0, 130, 16), (20, 50, 16), (300, 7, 16),
    (1100, 21, 16),  # a long cached context, as a cached prefix's suffix reads it
    (250, 19, 256),  # blocks longer than the flash kernel's key panels
])
@pytest.mark.parametrize("window", [None, 24])
def test_prefill_kernel_matches_causal_attention(dtype: torch.dtype, num_cached: int,
                                                 num: int, block_size: int,
                                                 window: int | None) -> None:
    gen = torch.Generator().manual_seed(num_cached + num)
    heads, kv_heads, head_dim = 9, 3, 64
    total = num_cached + num
    num_blocks = -(-total // block_size) + 3
    cache_k = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    cache_v = torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[: -(-total // block_size)]
    qk = torch.randn(num, heads + kv_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5

    got = native.prefill_attention(qk[:, :heads], cache_k, cache_v, table, num_cached, scale,
                                   window)

    # reference: every key of the sequence gathered, repeated per group, masked causally
    pos = torch.arange(total)
    slots = table[pos // block_size] * block_size + pos % block_size
    keys = cache_k.reshape(kv_heads, -1, head_dim)[:, slots].repeat_interleave(3, 0)
    values = cache_v.reshape(kv_heads, -1, head_dim)[:, slots].repeat_interleave(3, 0)
    visible = pos[None, :] <= (num_cached + torch.arange(num))[:, None]
    if window is not None:  # the last `window` positions only
        visible &= pos[None, :] > (num_cached + torch.arange(num))[:, None] - window
    scores = (qk[:, :heads].transpose(0, 1).double() @ keys.double().transpose(1, 2)) * scale
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    want = (weights @ values.double()).transpose(0, 1)
    _close(got, want.to(dtype))
