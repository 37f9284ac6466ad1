"""The repacked linear layer computes what F.linear does, and follows in-place weight changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qworker.model.kernels import native
from qworker.model.kernels import native_build as nb
from qworker.model.kernels.linear import Linear, onednn_packs, packing_available


def test_this_cpu_takes_the_fast_paths() -> None:
    assert packing_available()
    assert native.gemm_pack(torch.zeros(16, 32, dtype=torch.bfloat16)) is not None


# bfloat16: a rounding apart at most (the kernels sum in another order than oneDNN); float32 too
@pytest.mark.parametrize(("dtype", "kind", "tol"), [
    (torch.bfloat16, "native", 1e-2), (torch.float32, "native", 1e-5),
    (torch.float64, "plain", 0.0),
])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 130])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, kind: str, tol: float, bias: bool,
                                        rows: int) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, 208, bias=bias).to(dtype).requires_grad_(False)
    x = torch.randn(rows, 96).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=tol,
                                   rtol=tol)
    amx = dtype == torch.bfloat16 and native.amx_ready()  # the unmeasured default: AMX first
    assert layer.pack()[0] == ("amx" if amx else kind)


def test_an_in_place_weight_change_is_seen() -> None:
    layer = Linear(32, 16, bias=False).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(3, 32).to(torch.bfloat16)
    with torch.inference_mode():
        before = layer(x)
        layer.weight.mul_(2)
        after = layer(x)
    torch.testing.assert_close(after, 2 * before)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("width", [2, 64, 90, 576])
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 70])
@pytest.mark.parametrize("outputs", [16, 48, 80, 960])  # whole and partial 48-column groups
def test_gemm_matches_f_linear(dtype: torch.dtype, tol: float, width: int, rows: int,
                               outputs: int) -> None:
    gen = torch.Generator().manual_seed(width + rows + outputs)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    weight = torch.randn(outputs, width, generator=gen).to(dtype)
    bias = torch.randn(outputs, generator=gen).to(dtype)
    packed = native.gemm_pack(weight)
    assert packed is not None
    want = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(native.gemm(x, packed, bias).double(), want, atol=5 * tol,
                               rtol=tol)


def _skip_without_amx() -> None:
    if not native.amx_ready():
        pytest.skip(f"no AMX GEMM here ({native.status().level} build on {nb.cpu_model()}): "
                    "needs amx_bf16 and the amx level; absent hardware")


# one 16-row slice, two, a partial one after whole ones; one block of columns, an odd count
@pytest.mark.parametrize("width", [32, 64, 576, 1536])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 31, 32, 33, 70, 300])
@pytest.mark.parametrize("outputs", [16, 48, 80, 960])
def test_amx_gemm_matches_f_linear(width: int, rows: int, outputs: int) -> None:
    _skip_without_amx()
    gen = torch.Generator().manual_seed(width + rows + outputs)
    x = torch.randn(rows, width, generator=gen).to(torch.bfloat16)
    weight = torch.randn(outputs, width, generator=gen).to(torch.bfloat16)
    bias = torch.randn(outputs, generator=gen).to(torch.bfloat16)
    packed = native.gemm_pack(weight)
    assert packed is not None and native.amx_serves(weight)
    want = F.linear(x.double(), weight.double(), bias.double())
    got = native.gemm(x, packed, bias, amx=True).double()
    torch.testing.assert_close(got, want, atol=5e-2, rtol=1e-2)  # products exact, sums in float
    torch.testing.assert_close(native.gemm(x, packed, None, amx=True).double(),
                               want - bias.double(), atol=5e-2, rtol=1e-2)


def test_amx_declines_a_depth_off_its_tile() -> None:
    _skip_without_amx()
    assert not native.amx_serves(torch.zeros(16, 48, dtype=torch.bfloat16))  # 48 % 32
    assert not native.amx_serves(torch.zeros(16, 64, dtype=torch.float32))  # bfloat16 only
    assert native.amx_serves(torch.zeros(16, 64, dtype=torch.bfloat16))


def test_pair_pack_declines_what_the_kernel_does_not_take() -> None:
    assert native.gemm_pack(torch.zeros(20, 64, dtype=torch.bfloat16)) is None  # 20 % 16
    assert native.gemm_pack(torch.zeros(16, 63, dtype=torch.bfloat16)) is None  # odd width
    assert native.gemm_pack(torch.zeros(16, 64, dtype=torch.float64)) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_without_the_native_gemm_onednn_packs(dtype: torch.dtype,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "gemm_serves", lambda weight: False)  # no native level here
    layer = Linear(64, 32).to(dtype).requires_grad_(False)
    x = torch.randn(5, 64).to(dtype)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-2,
                                   rtol=1e-2)
    # bfloat16 packing needs AVX512-BW/VL/DQ or AVX-NE-CONVERT in oneDNN; F.linear elsewhere
    assert layer.pack()[0] == ("onednn" if onednn_packs(dtype) else "plain")
